"""Every DDP script is a lesson part above one fence and the hardening below it: the hardening is one
block shared by all, the lesson parts stay short enough to read in one sitting, and the minimal forms
(the lesson parts with plain code where they call into the hardening) are current and train exactly
as the full scripts do."""
import ast
import contextlib
import difflib
import io
import socket
import sys

import pytest
from helpers import REPO, SCRIPTS, load_script

sys.path.insert(0, str(REPO / "tools"))
import make_minimal  # noqa: E402

DDP_SCRIPTS = make_minimal.ddp_scripts()
IDS = [p.name for p in DDP_SCRIPTS]
# Targets for the lesson parts (added non-blank lines of a diff; lines of a lesson part).
LESSON_2_ADDS_AT_MOST = 130
LESSON_2_PART_AT_MOST = 380
NEIGHBOUR_ADDS_AT_MOST = 180
# Each lesson and the one a learner diffs it against (its docstring says which).
NEIGHBOURS = [("mnist_ddp_cpu.py", "mnist_ddp_gpu.py"), ("gcn_single.py", "gcn_ddp.py"),
              ("mnist_ddp_gpu.py", "mnist_ddp_resume.py"), ("mnist_ddp_gpu.py", "mnist_ddp_comm.py"),
              ("mnist_ddp_cpu.py", "mnist_ddp_debug.py"), ("mnist_ddp_gpu.py", "mnist_fsdp.py")]
# What a lesson teaches stays above the fence, where the learner reads it.
TAUGHT = {"mnist_ddp_gpu.py": {"check_device"},
          "mnist_ddp_resume.py": {"read_snapshot", "load_snapshot", "save_snapshot", "crash"},
          "mnist_ddp_comm.py": {"time_allreduce"},
          "mnist_ddp_debug.py": {"Watchdog", "check_replicas", "inject_bug"},
          "mnist_fsdp.py": {"check_sharding", "state_bytes", "peak_mib", "save_checkpoint",
                            "load_checkpoint"},
          "gcn_ddp.py": {"check_device", "rank_chunk", "mapped_copy", "prepare_graph"}}


def added_lines(before, after):
    """Non-blank lines that the diff from `before` to `after` (lists of lines) adds."""
    return sum(1 for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++") and line[1:].strip())


def lesson(name):
    path = SCRIPTS / name
    return make_minimal.lesson_lines(path) if path in DDP_SCRIPTS else path.read_text().splitlines()


def defined(text):
    return {node.name for node in ast.parse(text).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_ddp_scripts_are_the_ones_expected():
    assert set(IDS) >= {"mnist_ddp_cpu.py", "mnist_ddp_gpu.py", "mnist_ddp_resume.py", "mnist_ddp_comm.py",
                        "mnist_ddp_debug.py", "gcn_ddp.py", "template_ddp.py"}


@pytest.mark.parametrize("path", DDP_SCRIPTS, ids=IDS)
def test_one_fence_then_the_shared_block(path):
    lesson_part, shared, extra, guard = make_minimal.split(path)  # raises unless exactly one fence
    assert shared.startswith("# ===") and "hardening" in shared.splitlines()[0]
    assert guard.startswith('if __name__ == "__main__":')
    assert not extra or extra.startswith("# ---") and "hardening" in extra.splitlines()[0]
    missing = TAUGHT.get(path.name, set()) - defined(lesson_part)
    assert not missing, f"{path.name}: {missing} should be above the fence, with the lesson"


def test_the_shared_hardening_block_is_identical_in_every_ddp_script():
    blocks = {path.name: make_minimal.split(path)[1] for path in DDP_SCRIPTS}
    reference = blocks["mnist_ddp_cpu.py"]
    differ = [name for name, block in blocks.items() if block != reference]
    assert not differ, f"the shared hardening differs in {differ}: copy mnist_ddp_cpu.py's block there"


def test_lesson_2_adds_little_to_lesson_1():
    single, cpu = lesson("mnist_single.py"), lesson("mnist_ddp_cpu.py")
    assert added_lines(single, cpu) <= LESSON_2_ADDS_AT_MOST
    assert len(cpu) <= LESSON_2_PART_AT_MOST


def test_every_ddp_script_has_its_neighbour():
    """Every lesson but the first is read against the one before it (the template is no lesson)."""
    assert {script for _, script in NEIGHBOURS} | {"mnist_ddp_cpu.py", "template_ddp.py"} == set(IDS)
    for earlier, script in NEIGHBOURS:
        assert f"Compare it with {earlier}" in (SCRIPTS / script).read_text()


@pytest.mark.parametrize("earlier, script", NEIGHBOURS, ids=[pair[1] for pair in NEIGHBOURS])
def test_each_lesson_part_adds_little_to_its_neighbour(earlier, script):
    assert added_lines(lesson(earlier), lesson(script)) <= NEIGHBOUR_ADDS_AT_MOST


def test_the_limits_can_fail():
    """The counting sees a change: 200 new lines are 200 added lines."""
    cpu = lesson("mnist_ddp_cpu.py")
    assert added_lines(cpu, cpu) == 0
    assert added_lines(cpu, cpu[:100] + [f"x = {i}" for i in range(200)] + cpu[100:]) == 200


def test_the_minimal_forms_are_current():
    """ddp_scripts/minimal/ is written by `make minimal`: after editing a DDP script, run it."""
    stale = [path.name for path in DDP_SCRIPTS
             if not (SCRIPTS / "minimal" / path.name).exists()
             or (SCRIPTS / "minimal" / path.name).read_text() != make_minimal.minimal_form(path)]
    assert not stale, f"stale minimal forms {stale}: run `make minimal`"
    extra = {p.name for p in (SCRIPTS / "minimal").glob("*.py")} - set(IDS)
    assert not extra, f"minimal forms of scripts that no longer exist: {extra}"


@pytest.mark.parametrize("path", DDP_SCRIPTS, ids=IDS)
def test_the_minimal_form_replaces_every_seam(path):
    text = (SCRIPTS / "minimal" / path.name).read_text()
    ast.parse(text)
    assert "# plain:" not in text and "hardening" not in text.split('"""', 2)[2]
    _, shared, extra, _ = make_minimal.split(path)
    used = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
    assert not used & defined(shared + extra)


def test_a_seam_replacement_is_checked():
    text = ("import os\nimport sys\n\nx = hardened(1)  # plain: x = 1\ny = 2  # plain: nothing\n"
            "print(sys.argv)\n")
    assert make_minimal.drop_unused_imports(make_minimal.replace_seams(text)) == \
        "import sys\n\nx = 1\nprint(sys.argv)\n"


def test_the_parser_does_no_network_io(monkeypatch):
    """A typo is refused by the parser alone (no store, no socket); under torchrun, run_main then
    answers the roll call with it (tests/cluster/test_refusals_under_torchrun.py)."""
    cpu = load_script("mnist_ddp_cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    def no_network(*args, **kwargs):
        raise AssertionError("the parser opened a connection")

    monkeypatch.setattr(cpu.dist, "TCPStore", no_network)
    monkeypatch.setattr(socket, "socket", no_network)
    with pytest.raises(cpu.UsageError, match="--epochs"), contextlib.redirect_stderr(io.StringIO()):
        cpu.parse_args(["--epochs", "0"])


def test_the_notebooks_show_the_lesson_parts_that_the_limits_count():
    """course_helpers.lesson_text() (what the notebooks print and diff) reads a script as
    make_minimal does, without importing the maintainers' tools."""
    sys.path.insert(0, str(REPO / "notebooks"))
    import course_helpers

    for path in DDP_SCRIPTS:
        assert course_helpers.lesson_text(path.name) == make_minimal.lesson_view(path), path.name
