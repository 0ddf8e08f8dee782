"""A lesson's study time, estimated by one rule, so that every lesson states it the same way:

    minutes = words / 150 + 5 x exercises, rounded up to a multiple of 5

where `words` counts the words (whitespace-separated) of every Markdown and code cell, read at
150 words a minute, and each exercise of the `## Exercises` section gets 5 minutes. The compute
time (the `**Time:**` line) is measured instead, not estimated.

    python tools/generate/study_time.py            # print each lesson's estimate
    python tools/generate/study_time.py --write    # write it into each lesson's first cell and the README

tests/unit/test_notebooks.py fails when a lesson or the README states another number than the rule
gives: after editing a lesson, run `make study-times`.
"""
import argparse
import math
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
WORDS_PER_MINUTE = 150
MINUTES_PER_EXERCISE = 5
LINE = re.compile(r"^\*\*Study time:\*\* .*$", re.M)


def lessons():
    return sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def exercises(nb):
    """The numbered items of the lesson's `## Exercises` section."""
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    if "## Exercises" not in text:
        return 0
    return len(re.findall(r"^\d+\. ", text.split("## Exercises", 1)[1], re.M))


def words(nb):
    """Words of the cells a reader reads (the first cell's study-time line left out)."""
    return sum(len(LINE.sub("", c.source).split()) for c in nb.cells if c.cell_type in ("markdown", "code"))


def estimate(path):
    """(minutes, words, exercises) of a lesson by the rule above."""
    nb = nbformat.read(path, as_version=4)
    w, e = words(nb), exercises(nb)
    minutes = w / WORDS_PER_MINUTE + MINUTES_PER_EXERCISE * e
    return 5 * math.ceil(minutes / 5), w, e


def sentence(minutes):
    return (f"**Study time:** about {minutes} minutes to read it and do the exercises (an estimate: "
            f"{WORDS_PER_MINUTE} words a minute and {MINUTES_PER_EXERCISE} minutes an exercise).")


def stated(path):
    """The minutes a lesson's first cell states, or None."""
    first = nbformat.read(path, as_version=4).cells[0].source
    found = re.search(r"^\*\*Study time:\*\* about (\d+) minutes", first, re.M)
    return int(found[1]) if found else None


def write(path, minutes):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    if LINE.search(first.source):
        first.source = LINE.sub(sentence(minutes), first.source)
    else:  # after the compute-time paragraph
        first.source = re.sub(r"(^\*\*Time:\*\*.*$)", lambda m: m[1] + "\n\n" + sentence(minutes),
                              first.source, count=1, flags=re.M)
    nbformat.write(nb, path)


def write_readme(estimates):
    readme = REPO / "README.md"
    text = readme.read_text()
    for path, minutes in estimates.items():
        number = int(path.name[:2])
        text, n = re.subn(rf"^(\| {number} \| .*\| [\d.]+ (?:s|min) / [\d.]+ (?:s|min) \|) [^|]* \|$",
                          rf"\1 {minutes} min |", text, flags=re.M)
        if n != 1:
            sys.exit(f"study_time: README.md has no lesson-table row for lesson {number}")
    readme.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="write the estimates into the lessons and README")
    args = parser.parse_args()
    estimates = {}
    for path in lessons():
        minutes, w, e = estimate(path)
        estimates[path] = minutes
        print(f"{path.name:<40} {w:>6} words  {e} exercises  -> {minutes} minutes (states {stated(path)})")
        if args.write:
            write(path, minutes)
    if args.write:
        write_readme(estimates)
        print("wrote the estimates into the lessons' first cells and README.md")


if __name__ == "__main__":
    main()
