"""Render every lesson and solution notebook, executed in full (SMOKE = False) on this machine, into
docs/lessons/NAME.md: Markdown with the run's outputs and figures (NAME_files/), which GitHub and
any Markdown viewer show without a kernel.

Each page starts with a stamp: the machine, the torch version, the data the run used, the date, the
minutes the notebook took to run, and sha256 hashes of the notebook's cells (prose too) and of the
scripts it launches (the ddp_scripts/ and tools/lab/ files its code names, and the lesson scripts
those import). tests/unit/
test_rendered_lessons.py compares those hashes with the files as they are now (it renders nothing)
and names the command that renders a stale page again.

    python tools/generate/render_lessons.py                      # every notebook (make pages)
    python tools/generate/render_lessons.py 05 13_which_parallelism_solutions   # those named
    python tools/generate/render_lessons.py --again [NAME ...]   # from the last run (build/rendered/)
    python tools/generate/render_lessons.py --executed DIR --out DIR    # render executed notebooks only

The notebooks run with notebooks/ (or notebooks/solutions/) as working directory, as in Jupyter.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
import compute_times  # noqa: E402  (the lessons' **Time:** lines)
from compute_times import STAMP, machine  # noqa: E402
from run_notebooks import execute  # noqa: E402  (papermill, as make notebooks runs them)
PAGES = REPO / "docs" / "lessons"
SCRIPT_DIRS = [REPO / "ddp_scripts", REPO / "tools" / "lab"]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def notebooks():
    """Every lesson, then every solution, in the course's order."""
    return (sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
            + sorted((REPO / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb")))


def sha256(data):
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def cells_hash(path):
    """The notebook's cells as a reader sees them: each one's type and source, prose and code; a
    lesson's `**Time:**` line left out (it states the runs, compute_times.py writes it)."""
    cells = json.loads(Path(path).read_text())["cells"]
    return sha256(json.dumps([[c["cell_type"], compute_times.without_line("".join(c["source"]))]
                              for c in cells]))


def launched_scripts(path):
    """The repository's scripts a notebook's code names (`mnist_ddp_cpu.py`, `import allreduce_by_hand`),
    as paths relative to the repository: what its outputs come from besides its own cells."""
    cells = json.loads(Path(path).read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    names = set(re.findall(r"\b(\w+)\.py\b", code))
    names |= set(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M))
    found = [d / f"{name}.py" for name in names for d in SCRIPT_DIRS if (d / f"{name}.py").is_file()]
    sys.path.insert(0, str(REPO / "notebooks"))
    from course_helpers import BASE_SCRIPTS, course_imports  # (tools import from notebooks/)

    # A later lesson's script runs lesson 2's or 3's launching and epoch: its outputs come from those
    # too (the modules it imports do not stale a page: decision 12).
    found += [SCRIPT_DIRS[0] / f for p in list(found) if p.parent == SCRIPT_DIRS[0]
              for f in course_imports(p.name) if f in BASE_SCRIPTS]
    return sorted({str(p.relative_to(REPO)) for p in found})


def scripts_hashes(path):
    return {script: sha256((REPO / script).read_bytes()) for script in launched_scripts(path)}


def stamp_of(page):
    """The stamp a rendered page carries, as a dict (None when it has none)."""
    match = STAMP.search(Path(page).read_text())
    return json.loads(match.group(1)) if match else None


def data_used(scripts):
    """What the launched scripts trained on here: MNIST when its files are in data/, else the offline
    fallback; lesson 4's graph is synthetic offline (the notebook asks for it)."""
    sys.path.insert(0, str(REPO / "ddp_scripts"))
    import mnist_parts

    used = []
    if any(Path(s).name.startswith("mnist_") for s in scripts):
        used.append("MNIST" if mnist_parts.have_files("mnist", str(REPO / "data")) else
                    "Fashion-MNIST (MNIST's offline fallback)")
    if any(Path(s).name.startswith("gcn_") for s in scripts):
        used.append("the scripts' synthetic graph")
    return " and ".join(used) or "no data set"


def wants_a_gpu(source):
    """Whether the lesson (a solution: its lesson) names GPUs in the hardware its first cell asks for."""
    lesson = sorted((REPO / "notebooks").glob(f"{Path(source).name[:3]}*.ipynb"))
    if not lesson:
        return False
    first = "".join(json.loads(lesson[0].read_text())["cells"][0]["source"])
    return any("GPU" in line for line in first.splitlines() if line.startswith("**Hardware:**"))


def relink(text, source_dir, page_dir, pages, own_files):
    """Relative links and images of a notebook in source_dir, made relative to page_dir; a link to
    another rendered notebook goes to its page; the page's own figures (own_files/) stay."""
    def fix(target):
        if re.match(r"^([a-z]+:|#|/)", target) or target.startswith(f"{own_files}/"):
            return target
        path, _, anchor = target.partition("#")
        absolute = (source_dir / path).resolve()
        if absolute.suffix == ".ipynb" and absolute.stem in pages:
            absolute = page_dir / f"{absolute.stem}.md"
        new = os.path.relpath(absolute, page_dir).replace(os.sep, "/")
        return new + (f"#{anchor}" if anchor else "")

    def fix_line(line):
        def fixed(m):
            return m.group(1) + fix(m.group(2)) + m.group(3)

        return re.sub(r'((?:src|href)=")([^"]+)(")', fixed, re.sub(r"(\]\()([^)\s]+)(\))", fixed, line))

    return "\n".join(fix_line(line) if prose else line for line, prose in prose_lines(text))


def prose_lines(text):
    """(line, whether it is prose): not inside a fenced code block (a code cell, a snippet) nor
    indented as code (a cell's output), where `f(x)[i](y)` is code, not a link."""
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            yield line, False
        else:
            yield line, not fenced and not line.startswith(("    ", "\t"))


def links(text):
    """Every link and image target in a page's prose: [text](target), src="...", href="..."."""
    prose = "\n".join(line for line, is_prose in prose_lines(text) if is_prose)
    return [a or b for a, b in re.findall(r"\]\(([^)\s]+)\)|(?:src|href)=\"([^\"]+)\"", prose)]


def render(executed, source, out, stamp, pages):
    """Write out/STEM.md (and out/STEM_files/) from an executed notebook, stamped."""
    from nbconvert import MarkdownExporter
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    stem = Path(source).stem
    files = f"{stem}_files"
    exporter = MarkdownExporter()
    exporter.register_preprocessor(CoalesceStreamsPreprocessor(), enabled=True)  # a cell's lines, one block
    body, resources = exporter.from_filename(
        str(executed), resources={"output_files_dir": files, "unique_key": stem})
    if (out / files).exists():
        for old in (out / files).iterdir():
            old.unlink()
    for name, data in resources.get("outputs", {}).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    folder = REPO / "notebooks" / ("solutions" if stem.endswith("_solutions") else "")
    body = relink(ANSI.sub("", body), folder, out, pages, files)  # its links as written, from where it lives
    notebook = os.path.relpath(source, out).replace(os.sep, "/")
    scripts = ", ".join(f"`{Path(s).name}`" for s in stamp["scripts"]) or "none"
    header = (f"<!-- rendered: {json.dumps(stamp)} -->\n"
              f"> **A rendered run** of [{Path(source).name}]({notebook}), executed in full "
              f"(`SMOKE = False`) on {stamp['machine']}, torch {stamp['torch']}, with {stamp['data']}, "
              f"on {stamp['date']}, in {stamp['minutes']:.1f} minutes. Scripts it launched: {scripts}. "
              f"Open the notebook to run it yourself; `make pages NB={stem}` renders this page again.\n\n")
    if "no GPU" in stamp["machine"] and wants_a_gpu(source):
        measured = os.path.relpath(REPO / "docs" / "MEASURED.md", out)
        header += ("> This machine has no GPU: the cells that need one say so where they stand; the "
                   f"course's runs on GPUs are in [MEASURED]({measured}).\n\n")
    (out / f"{stem}.md").write_text(header + body.rstrip() + "\n")
    return out / f"{stem}.md"


def title(path):
    """The notebook's first Markdown heading, else its file name."""
    for cell in json.loads(Path(path).read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return Path(path).stem


def write_index(out):
    """out/README.md (what GitHub shows for the folder): every rendered page, lesson by lesson."""
    rows = []
    for nb in notebooks():
        page = out / f"{nb.stem}.md"
        if page.exists() and nb.parent.name == "notebooks":
            solutions = out / f"{nb.stem}_solutions.md"
            stamp = stamp_of(page)
            rows.append(f"| [{title(nb)}]({page.name}) | "
                        + (f"[solutions]({solutions.name})" if solutions.exists() else "") + " | "
                        + f"{stamp['machine']}, {stamp['date']}, {stamp['minutes']:.1f} min |")
    (out / "README.md").write_text(
        "# The lessons, run\n\nEach lesson and its solutions as one full run (`SMOKE = False`) left "
        "them, with their outputs and figures: generated by `make pages` (tools/generate/render_lessons.py), "
        "not edited by hand. To run a lesson yourself, open its notebook in `notebooks/`.\n\n"
        "| lesson | exercises | rendered on |\n|---|---|---|\n" + "\n".join(rows) + "\n")


def chosen_by(notebook, name):
    """A name picks the notebook of that exact name, else every one whose name starts with it."""
    exact = any(nb.stem == name for nb in notebooks())
    return notebook.stem == name if exact else notebook.stem.startswith(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to render (a prefix of the file name: 05, "
                        "13_which_parallelism_solutions); default every one")
    parser.add_argument("--executed", type=Path,
                        help="render the executed notebooks in this folder (their links as from notebooks/), "
                             "run nothing")
    parser.add_argument("--again", action="store_true",
                        help="render again from the last run's executed notebooks (build/rendered/), run "
                             "nothing: after a change to this renderer; refused for a notebook or a script "
                             "changed since that run")
    parser.add_argument("--out", type=Path, default=PAGES)
    args = parser.parse_args()
    if args.executed:
        chosen = sorted(args.executed.glob("*.ipynb"))
        if not chosen:
            sys.exit(f"render_lessons: no notebooks in {args.executed}")
    else:
        chosen = [nb for nb in notebooks() if not args.names or any(chosen_by(nb, n) for n in args.names)]
        if not chosen:
            sys.exit(f"render_lessons: no notebook named {' '.join(args.names)}; "
                     f"the names start with {', '.join(nb.stem[:2] for nb in notebooks()[:13])}")
    args.out.mkdir(parents=True, exist_ok=True)
    the_machine, torch_version = machine()
    pages = {nb.stem for nb in notebooks()} | {nb.stem for nb in chosen}
    build = REPO / "build" / "rendered"
    build.mkdir(parents=True, exist_ok=True)
    start_all = time.monotonic()
    for number, source in enumerate(chosen, 1):
        print(f"[{number}/{len(chosen)}] {source.name} ({len(chosen) - number} after it) ...", flush=True)
        start = time.monotonic()
        executed = source if args.executed else build / source.name
        stamp = {"notebook": os.path.relpath(source, REPO), "cells": cells_hash(source),
                 "scripts": scripts_hashes(source), "machine": the_machine, "torch": torch_version,
                 "data": data_used(launched_scripts(source)), "date": date.today().isoformat()}
        if args.again:
            page = args.out / f"{source.stem}.md"
            old = stamp_of(page) if page.exists() else None
            if not (executed.exists() and old and old["cells"] == stamp["cells"]
                    and old["scripts"] == stamp["scripts"]):
                sys.exit(f"render_lessons: {source.name} changed since its last run (or has none in "
                         f"{build}): run `make pages NB={source.stem}`")
            stamp = old  # the run's own facts: its machine, date and minutes
        elif not args.executed:
            execute(source, executed, smoke=False)
        stamp.setdefault("minutes", round((time.monotonic() - start) / 60, 1))
        page = render(executed, source, args.out, stamp, pages)
        print(f"  {stamp['minutes']:.1f} min -> {os.path.relpath(page, REPO)}", flush=True)
        if args.out == PAGES and source.parent.name == "notebooks":
            try:  # the lesson's **Time:** line, from this run and the smoke record
                compute_times.write(source.stem)
            except SystemExit as missing:
                print(f"  its **Time:** line is left as it was: {missing}", flush=True)
    if not args.executed:
        write_index(args.out)
    print(f"rendered {len(chosen)} page(s) in {(time.monotonic() - start_all) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
