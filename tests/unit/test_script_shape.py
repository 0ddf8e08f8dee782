"""The shape of ddp_scripts/ (docs/decisions/0013-each-fact-once-across-the-lessons.md): each lesson
script is its lesson, read top to bottom; what several scripts share is written once, in a module
they import (ddp_hardening.py, mnist_parts.py, gcn_parts.py) or in the lesson that teaches it
(lessons 2 and 3's launching, which later lessons run); the scripts stay short enough to read in
one sitting and to diff against the lesson before."""
import ast
import contextlib
import difflib
import io
import re
import socket

import pytest
from course_helpers import BASE_SCRIPTS
from helpers import MODULES, SCRIPTS, load_script

SCRIPT_FILES = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name not in MODULES)
# Every script that starts a DDP job imports the hardening module as `hardening`.
DDP_SCRIPTS = sorted(name for name in SCRIPT_FILES
                     if "import ddp_hardening as hardening" in (SCRIPTS / name).read_text())
# Targets (lines of a file; added non-blank lines of a unified diff).
SCRIPT_AT_MOST = 600
LESSON_2_AT_MOST = 300
LESSON_2_ADDS_AT_MOST = 130
SHARED_RUN, SHARED_PAIRS_AT_MOST = 6, 10  # pairs of files sharing a run of lines
NEIGHBOUR_ADDS_AT_MOST = 200  # a later lesson's own lines: what its diff against its neighbour adds
# Each lesson and the one a learner diffs it against (its docstring says which).
NEIGHBOURS = [("mnist_ddp_cpu.py", "mnist_ddp_gpu.py"), ("gcn_single.py", "gcn_ddp.py"),
              ("mnist_ddp_gpu.py", "mnist_ddp_resume.py"), ("mnist_ddp_gpu.py", "mnist_ddp_comm.py"),
              ("mnist_ddp_cpu.py", "mnist_ddp_debug.py"), ("mnist_ddp_gpu.py", "mnist_fsdp.py"),
              ("mnist_ddp_cpu.py", "mnist_ddp_practice.py")]
# What a lesson teaches stays in its script, where the learner reads it.
TAUGHT = {"mnist_ddp_cpu.py": {"worker", "main", "parser"},
          "mnist_ddp_gpu.py": {"worker", "main", "parser", "mixed_precision", "train_epoch"},
          "mnist_ddp_resume.py": {"read_snapshot", "load_snapshot", "save_snapshot", "crash_midway",
                                  "remove_stale_parts"},
          "mnist_ddp_comm.py": {"time_allreduce"},
          "mnist_ddp_debug.py": {"Watchdog", "dump_flight_recorder", "check_replicas", "inject_bug"},
          "mnist_fsdp.py": {"check_sharding", "state_bytes", "peak_mib", "save_checkpoint",
                            "load_checkpoint"},
          "gcn_ddp.py": {"check_setup", "rank_chunk", "mapped_copy", "prepare_graph", "load_mapped"},
          "mnist_ddp_practice.py": {"SyncBatchNormFunction", "SyncBatchNorm", "BNNet", "replica_spread"}}
# What a copy may import: torch and its kin, the standard library, the course's modules, and the
# scripts of lessons 2 and 3, whose launching and command line the later lessons run.
ALLOWED = ({"torch", "torchvision", "tqdm", "torch_geometric", "ogb"} | {m[:-3] for m in MODULES}
           | {s[:-3] for s in BASE_SCRIPTS})


def lines(name):
    return (SCRIPTS / name).read_text().splitlines()


def added_lines(before, after):
    """Non-blank lines that the diff from `before` to `after` (lists of lines) adds."""
    return sum(1 for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++") and line[1:].strip())


def top_level(path):
    """{name: the definition's AST, dumped} of a file's top-level functions and classes."""
    return {node.name: ast.dump(node) for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_ddp_scripts_are_the_ones_expected():
    assert set(DDP_SCRIPTS) == {"mnist_ddp_cpu.py", "mnist_ddp_gpu.py", "mnist_ddp_resume.py",
                                "mnist_ddp_comm.py", "mnist_ddp_debug.py", "mnist_fsdp.py", "gcn_ddp.py",
                                "template_ddp.py", "mnist_ddp_practice.py"}


@pytest.mark.parametrize("path", sorted(SCRIPTS.rglob("*.py")), ids=lambda p: p.name)
def test_no_file_is_longer_than_a_sitting(path):
    assert len(path.read_text().splitlines()) <= SCRIPT_AT_MOST


def test_lesson_2_adds_little_to_lesson_1():
    single, cpu = lines("mnist_single.py"), lines("mnist_ddp_cpu.py")
    assert added_lines(single, cpu) <= LESSON_2_ADDS_AT_MOST
    assert len(cpu) <= LESSON_2_AT_MOST


def test_every_ddp_script_has_its_neighbour():
    """Every lesson but the first is read against the one before it (the template is no lesson)."""
    assert {script for _, script in NEIGHBOURS} | {"mnist_ddp_cpu.py", "template_ddp.py"} == set(DDP_SCRIPTS)
    for earlier, script in NEIGHBOURS:
        assert f"Compare it with {earlier}" in (SCRIPTS / script).read_text()


@pytest.mark.parametrize("earlier, script", NEIGHBOURS, ids=[pair[1] for pair in NEIGHBOURS])
def test_each_lesson_adds_little_to_its_neighbour(earlier, script):
    assert added_lines(lines(earlier), lines(script)) <= NEIGHBOUR_ADDS_AT_MOST


def test_the_limits_can_fail():
    """The counting sees a change: 200 new lines are 200 added lines."""
    cpu = lines("mnist_ddp_cpu.py")
    assert added_lines(cpu, cpu) == 0
    assert added_lines(cpu, cpu[:100] + [f"x = {i}" for i in range(200)] + cpu[100:]) == 200


@pytest.mark.parametrize("script", sorted(TAUGHT))
def test_what_a_lesson_teaches_stays_in_its_script(script):
    missing = TAUGHT[script] - set(top_level(SCRIPTS / script))
    assert not missing, f"{script}: {missing} should be defined in the script, with the lesson"


@pytest.mark.parametrize("script", DDP_SCRIPTS)
def test_each_call_into_the_hardening_says_what_plain_code_it_stands_for(script):
    """A `hardening.` call has its `# plain: <code>` at the end of its line or on a comment line
    right above the statement: the learner reads what the call replaces without opening the
    module. The calls are few: a handful, not the lesson (fewer still in a lesson that runs lesson 2
    or 3's launching, where most of them are)."""
    text = lines(script)
    calls = [i for i, line in enumerate(text) if re.search(r"\bhardening\.\w+\(", line)]
    unsaid = [text[i].strip() for i in calls
              if not any("# plain:" in text[j] for j in range(max(0, i - 2), i + 1))]
    assert not unsaid, f"{script}: hardening calls without '# plain: ...': {unsaid}"
    assert 1 <= len(calls) <= 12


def test_each_definition_is_written_once():
    """No function or class of ddp_scripts/ stands, the same, in two files: what two scripts share
    lives in a module, or in the lesson that teaches it (lessons 2 and 3's launching, which the
    later lessons call with their own train())."""
    seen, twice = {}, []
    for path in sorted(SCRIPTS.glob("*.py")):
        for name, dump in top_level(path).items():
            if (name, dump) in seen:
                twice.append(f"{name} in {seen[name, dump]} and {path.name}")
            seen.setdefault((name, dump), path.name)
    assert not twice, twice


def test_the_definitions_check_can_fail(tmp_path):
    """Two files defining one function alike are seen as such; a changed body is not."""
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "b.py").write_text("def f():\n    return 1\n")
    (tmp_path / "c.py").write_text("def f():\n    return 2\n")
    assert top_level(tmp_path / "a.py") == top_level(tmp_path / "b.py") != top_level(tmp_path / "c.py")


EVERY_FILE = {'"""', ")", "]", "}", "):", "else:", "try:", "return", "pass"}  # lines too common to count


def shared_runs(a, b, run=SHARED_RUN):
    """Places where files `a` and `b` share `run` or more lines in a row, alike once stripped;
    blank lines, comments, imports and closing brackets left out (every file has those)."""
    def kept(path):
        stripped = (line.strip() for line in path.read_text().splitlines())
        return [s for s in stripped
                if s and not s.startswith(("import ", "from ", "#")) and s not in EVERY_FILE]
    first, second = kept(a), kept(b)
    windows = {tuple(second[i:i + run]) for i in range(len(second) - run + 1)}
    return [i for i in range(len(first) - run + 1) if tuple(first[i:i + run]) in windows]


def test_few_pairs_of_files_share_a_run_of_lines():
    """What is written once stays so (issue 35's target: at most 10 pairs of places sharing six
    or more lines). This finder sees identical lines only, not lines of the same shape, so it
    counts fewer pairs than a finder that does (6 here against 9). The pairs left are a lesson's
    train() beside its neighbour's (lesson 1 and 2, 2 and 3, the GCN's two scripts, ...), steps
    kept whole so that the diff between the two is the lesson."""
    files = sorted(SCRIPTS.rglob("*.py"))
    pairs = [f"{a.name} ~ {b.name}" for i, a in enumerate(files) for b in files[i + 1:] if shared_runs(a, b)]
    assert len(pairs) <= SHARED_PAIRS_AT_MOST, pairs


def test_the_shared_runs_check_can_fail(tmp_path):
    """Six lines alike in a row are seen; five, or six with one changed, are not."""
    body = [f"x{i} = {i}" for i in range(6)]
    (tmp_path / "a.py").write_text("\n".join(["a = 0"] + body))
    (tmp_path / "b.py").write_text("\n".join(body + ["b = 0"]))
    (tmp_path / "c.py").write_text("\n".join(body[:5] + ["x5 = 7"]))
    assert shared_runs(tmp_path / "a.py", tmp_path / "b.py") == [1]
    assert shared_runs(tmp_path / "a.py", tmp_path / "c.py") == []


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_scripts_import_only_what_a_copy_can_rely_on(script):
    import sys

    tree = ast.parse((SCRIPTS / script).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    others = roots - ALLOWED - set(sys.stdlib_module_names)
    assert not others, others


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_modules_never_reach_into_the_script_that_imports_them(module):
    """What a module needs from a script, it is passed (main, parse_args, worker, check ...): no
    `__main__`, and of the course's files only ddp_hardening.py (for UsageError)."""
    text = (SCRIPTS / module).read_text()
    assert "__main__" not in text
    assert "sys.modules" not in text.replace('sys.modules.setdefault("outdated"', "")  # ogb's quirk
    imported = {node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)}
    assert imported & {m[:-3] for m in MODULES} <= {"ddp_hardening"} - {module[:-3]}


def test_the_parser_does_no_network_io(monkeypatch):
    """A typo is refused by the parser alone (no store, no socket); under torchrun, run_main then
    answers the roll call with it (tests/cluster/test_refusals_under_torchrun.py)."""
    cpu = load_script("mnist_ddp_cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    def no_network(*args, **kwargs):
        raise AssertionError("the parser opened a connection")

    monkeypatch.setattr(cpu.hardening.dist, "TCPStore", no_network)
    monkeypatch.setattr(socket, "socket", no_network)
    with pytest.raises(cpu.hardening.UsageError, match="--epochs"), contextlib.redirect_stderr(io.StringIO()):
        cpu.parse_args(["--epochs", "0"])
