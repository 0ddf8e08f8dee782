"""Write ddp_scripts/minimal/: each DDP script's lesson part, every hardening call replaced by its
plain form, the hardening dropped (make minimal; tests/unit/test_lesson_parts.py fails when stale).

A DDP script has two parts, split by one fence line (a comment that starts with `# ===` and says
`hardening`): above it the lesson, below it the hardening, which starts with a block shared by every
DDP script and may go on, after a marker line (`# ---` ... `hardening`), with what one script alone
needs. The file ends with its `if __name__ == "__main__":` block. A lesson line that calls into the
hardening ends with `# plain: <code>`: the minimal form has <code> there instead (`# plain: nothing`:
the line is dropped). A statement too long for that (or spanning lines) has its `# plain: <code>` on
a comment line of its own right above it: the minimal form has <code> instead of the whole
statement. Imports that the minimal form no longer uses are dropped too.

    python tools/make_minimal.py                    # write ddp_scripts/minimal/ (make minimal)
    python tools/make_minimal.py --check            # only say whether it is current
    python tools/make_minimal.py --sync-hardening   # copy mnist_ddp_cpu.py's shared block to the others
"""
import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "ddp_scripts"
MINIMAL = SCRIPTS / "minimal"
FENCE = re.compile(r"^# ?=+.*hardening")
EXTRA = re.compile(r"^# ?-+.*hardening")
GUARD = 'if __name__ == "__main__":'
SEAM = re.compile(r"^(?P<indent>\s*)(?P<code>\S.*?)\s+# plain: (?P<plain>.*)$")
SEAM_ABOVE = re.compile(r"^(?P<indent>\s*)# plain: (?P<plain>.*)$")


def ddp_scripts():
    """The scripts with a hardening fence: every DDP script (the by-hand and one-process ones have
    none)."""
    return sorted(path for path in SCRIPTS.glob("*.py")
                  if any(FENCE.match(line) for line in path.read_text().splitlines()))


def split(path):
    """(lesson, shared hardening, extra hardening, guard) of a DDP script, as text."""
    lines = Path(path).read_text().splitlines(keepends=True)
    fences = [i for i, line in enumerate(lines) if FENCE.match(line)]
    if len(fences) != 1:
        raise ValueError(f"{path}: {len(fences)} fence lines ('# ===' ... 'hardening'), one expected")
    guards = [i for i, line in enumerate(lines) if line.startswith(GUARD)]
    if len(guards) != 1 or guards[0] < fences[0]:
        raise ValueError(f"{path}: the file must end with one `{GUARD}` block, after the hardening")
    fence, guard = fences[0], guards[0]
    extras = [i for i in range(fence, guard) if EXTRA.match(lines[i])]
    end_shared = extras[0] if extras else guard
    text = "".join
    return (text(lines[:fence]), text(lines[fence:end_shared]), text(lines[end_shared:guard]),
            text(lines[guard:]))


def lesson_view(path):
    """What a learner reads: the lesson part, then the file's __main__ block."""
    lesson, _, _, guard = split(path)
    return lesson.rstrip("\n") + "\n\n\n" + guard


def lesson_lines(path):
    """The lesson part only (above the fence): what the size limits count."""
    return split(path)[0].splitlines()


def replace_seams(text):
    """Each seam replaced by its plain form: a line that ends with `# plain: <code>`, or the
    statement below a `# plain: <code>` line (`nothing`: dropped)."""
    ends = {}  # first line of each statement -> its last line (the outermost statement there)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.stmt):
            ends[node.lineno] = max(ends.get(node.lineno, 0), node.end_lineno)
    out, skip_to = [], 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if number <= skip_to:
            continue
        above, seam = SEAM_ABOVE.match(line.rstrip("\n")), SEAM.match(line.rstrip("\n"))
        if above:
            if number + 1 not in ends:
                raise ValueError(f"line {number}: a '# plain:' line must stand right above the statement "
                                 f"it stands for")
            skip_to, seam = ends[number + 1], above
        if not seam:
            out.append(line)
        elif not re.match(r"nothing\b", seam["plain"]):
            out.append(f"{seam['indent']}{seam['plain']}\n")
    return "".join(out)


def drop_unused_imports(text):
    tree = ast.parse(text)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    drop = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
            unused = [n for n in names if n not in used]
            if unused and len(unused) < len(names):
                raise ValueError(f"line {node.lineno}: only some of {names} are unused; split the import")
            if unused:
                drop.update(range(node.lineno, node.end_lineno + 1))
    lines = text.splitlines(keepends=True)
    return "".join(line for number, line in enumerate(lines, 1) if number not in drop)


def minimal_form(path):
    path = Path(path)
    lesson, shared, extra, _ = split(path)
    text = drop_unused_imports(replace_seams(lesson_view(path)))
    hardening = ast.parse(shared + extra)
    gone = {node.name for node in hardening.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    used = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
    left = sorted(gone & used)
    if left:
        raise ValueError(f"{path.name}: the minimal form still uses {left}: give those lines a "
                         f"'# plain:' form")
    header = (f"# The minimal form of ../{path.name}, written by tools/make_minimal.py (make minimal):\n"
              f"# its lesson part, each call into the hardening replaced by the plain code it stands\n"
              f"# for. What that leaves out: ../README.md. Edit ../{path.name}, not this file.\n")
    return header + text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit code 1)")
    parser.add_argument("--sync-hardening", action="store_true",
                        help="first copy the shared hardening block of mnist_ddp_cpu.py (where it is "
                             "edited) into every other DDP script")
    args = parser.parse_args()
    if args.sync_hardening:
        shared = split(SCRIPTS / "mnist_ddp_cpu.py")[1]
        for path in ddp_scripts():
            lesson, old, extra, guard = split(path)
            if old != shared:
                path.write_text(lesson + shared + extra + guard)
                print(f"copied the shared hardening into {path.relative_to(REPO)}")
    stale = []
    for path in ddp_scripts():
        target = MINIMAL / path.name
        text = minimal_form(path)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.relative_to(REPO))
        if not args.check:
            MINIMAL.mkdir(exist_ok=True)
            target.write_text(text)
    written = {path.name for path in ddp_scripts()}
    extra = sorted(p.relative_to(REPO) for p in MINIMAL.glob("*.py") if p.name not in written)
    if args.check:
        if stale or extra:
            sys.exit(f"stale or extra minimal forms: {[str(p) for p in stale + extra]}: run make minimal")
        return
    for path in extra:
        (REPO / path).unlink()
    print(f"wrote {len(stale)} of {len(written)} minimal forms in {MINIMAL.relative_to(REPO)}/"
          + (f", removed {[str(p) for p in extra]}" if extra else ""))


if __name__ == "__main__":
    main()
