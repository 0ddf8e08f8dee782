"""A lesson's compute time, as measured: its `**Time:**` line, written from two records so that the
lesson, its rendered page and the README's table state the same run.

- smoke mode: the notebook run alone with SMOKE = True, as a reader runs it (papermill, each
  script a fresh Python): `python tools/generate/run_notebooks.py --smoke --record-times
  notebooks/[0-9]*.ipynb` records each lesson that ran into docs/measured/smoke_times.json, with the
  machine and the date. (The test suite's durations are shorter: its launches fork from a Python
  with torch imported already.)
- in full: the lesson's rendered run, the minutes its page's stamp records (docs/lessons/NAME.md,
  written by `make pages`).

    python tools/generate/compute_times.py            # print each lesson's times and what it states
    python tools/generate/compute_times.py --write    # write them into the lessons, pages and README

The line is left out of the rendered pages' hash of a notebook's cells (it describes a run, not
what a run depends on): writing it leaves the pages current. `make pages` writes it after each
render; tests/unit/test_notebooks.py fails when a lesson states other times than the records give.
Rounded as a reader needs them: under 10 s to the second, under 90 s to 10 s, else to half a minute.
"""
import argparse
import json
import re
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOKE_TIMES = REPO / "docs" / "measured" / "smoke_times.json"
PAGES = REPO / "docs" / "lessons"
LINE = re.compile(r"^\*\*Time:\*\* .* in full\b.*$", re.M)
STAMP = re.compile(r"^<!-- rendered: (\{.*\}) -->$", re.M)
sys.path.insert(0, str(Path(__file__).parent))
from study_time import lessons  # noqa: E402,F401  (the lessons, as the study times find them)


def readme_row(number):
    """The README's lesson-table row of a lesson; its groups: before, smoke, full, after (the study
    time's cell, whose minutes are group 5)."""
    return re.compile(rf"^(\| {number} \| \[.*\| )([\d.]+ (?:s|min)) / ([\d.]+ (?:s|min))( \| (\d+) min \|)$",
                      re.M)


def machine():
    """This machine in a few words ("AMD EPYC, 2 cores, no GPU") and the torch version."""
    import torch

    sys.path.insert(0, str(REPO / "tools" / "bench"))
    from bench import cores, cpu_name

    gpus = torch.cuda.device_count()
    gpu = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    return f"{cpu_name()}, {cores()} cores, {gpu}", torch.__version__


def record_smoke(seconds):
    """Merge {lesson's stem: seconds in smoke mode} measured here today into
    docs/measured/smoke_times.json."""
    if not seconds:
        return
    the_machine, torch_version = machine()
    record = json.loads(SMOKE_TIMES.read_text()) if SMOKE_TIMES.exists() else {}
    for stem, s in seconds.items():
        record[stem] = {"seconds": round(s, 1), "machine": the_machine, "torch": torch_version,
                        "date": date.today().isoformat()}
    SMOKE_TIMES.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")


def rounded(seconds):
    """'7 s', '40 s', '2.5 minutes' (at least 90 s: never '1 minute')."""
    if seconds < 9.5:
        return f"{max(1, round(seconds))} s"
    if seconds < 90:
        return f"{round(seconds / 10) * 10} s"
    return f"{round(seconds / 30) / 2:g} minutes"


def measured(stem):
    """(smoke record, rendered page's stamp) of a lesson; SystemExit naming what is missing."""
    smoke = json.loads(SMOKE_TIMES.read_text()).get(stem) if SMOKE_TIMES.exists() else None
    if smoke is None:
        sys.exit(f"compute_times: {stem} has no smoke time in {SMOKE_TIMES.relative_to(REPO)}: run "
                 f"`python tools/generate/run_notebooks.py --smoke --record-times notebooks/{stem}.ipynb`")
    page = PAGES / f"{stem}.md"
    found = STAMP.search(page.read_text()) if page.exists() else None
    if found is None:
        sys.exit(f"compute_times: {stem} has no rendered page: run `make pages NB={stem}`")
    return smoke, json.loads(found[1])


def times(stem, table=False):
    """(smoke, full) as the lesson states them, e.g. ('20 s', '2.5 minutes'); as the README's table
    writes them with `table` ('20 s', '2.5 min')."""
    smoke, stamp = measured(stem)
    both = rounded(smoke["seconds"]), rounded(stamp["minutes"] * 60)
    return tuple(t.replace(" minutes", " min") for t in both) if table else both


def sentence(stem):
    """The lesson's line: each time, and where and when it was measured (smoke mode's date first)."""
    smoke, stamp = measured(stem)
    fast, full = times(stem)
    if smoke["machine"] == stamp["machine"]:
        return (f"**Time:** {fast} in smoke mode (`SMOKE = True`), {full} in full, measured on "
                f"{smoke['machine']} ({smoke['date']}; {stamp['date']}).")
    return (f"**Time:** {fast} in smoke mode (`SMOKE = True`) on {smoke['machine']} ({smoke['date']}), "
            f"{full} in full on {stamp['machine']} ({stamp['date']}).")


def stated(text):
    """The `**Time:**` line a lesson's first cell (or its page) states, or None."""
    found = LINE.search(text)
    return found[0] if found else None


def without_line(text):
    """The text with its `**Time:**` line emptied: what the pages' hash of a notebook's cells reads."""
    return LINE.sub("", text)


def write(stem):
    """The line into the lesson's first cell, its rendered page and the README's table."""
    import nbformat

    line = sentence(stem)
    path = REPO / "notebooks" / f"{stem}.ipynb"
    nb = nbformat.read(path, as_version=4)
    if stated(nb.cells[0].source) != line:
        if not LINE.search(nb.cells[0].source):
            sys.exit(f"compute_times: {path.name}'s first cell has no line `**Time:** ... in full ...`")
        nb.cells[0].source = LINE.sub(lambda _: line, nb.cells[0].source, count=1)
        nbformat.write(nb, path)
    page = PAGES / f"{stem}.md"
    text = page.read_text()
    if stated(text) != line:
        page.write_text(LINE.sub(lambda _: line, text, count=1))
    readme = REPO / "README.md"
    text = readme.read_text()
    smoke, full = times(stem, table=True)
    new, n = readme_row(int(stem[:2])).subn(lambda m: f"{m[1]}{smoke} / {full}{m[4]}", text)
    if n != 1:
        sys.exit(f"compute_times: README.md has no lesson-table row for lesson {int(stem[:2])}")
    if new != text:
        readme.write_text(new)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the times into the lessons, pages "
                        "and README")
    args = parser.parse_args()
    for path in lessons():
        smoke, full = times(path.stem)
        print(f"{path.name:<40} smoke {smoke:>12}  full {full:>12}")
        if args.write:
            write(path.stem)
    if args.write:
        print("wrote the times into the lessons' first cells, their pages and README.md")


if __name__ == "__main__":
    main()
