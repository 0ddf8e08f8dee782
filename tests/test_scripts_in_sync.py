"""The scripts are self-contained copies, so the parts they share must not drift apart:
every top-level definition with the same name is identical, except the ones each lesson changes."""
import ast

import pytest
from conftest import SCRIPTS

MNIST_SHARED = {"prepare_data", "load_split", "ConvNet", "build_model"}
# (earlier lesson, next lesson, what the next lesson may change, what it must share):
# the diff is the lesson itself.
PAIRS = [
    ("mnist_single.py", "mnist_ddp_cpu.py", {"evaluate", "train", "parse_args", "main", "Parser"},
     MNIST_SHARED),
    ("mnist_ddp_cpu.py", "mnist_ddp_gpu.py", {"evaluate", "train", "worker", "check_setup", "parse_args"},
     MNIST_SHARED | {"prepare_in_turns", "roll_call", "attempt_store", "launch", "spawn_workers",
                     "spawned_worker"}),
    ("mnist_ddp_cpu.py", "mnist_ddp_debug.py", {"train", "parse_args"},
     MNIST_SHARED | {"evaluate", "worker", "launch", "check_setup", "roll_call", "attempt_store",
                     "prepare_in_turns", "Parser", "spawn_workers", "spawned_worker", "main", "positive"}),
    ("mnist_ddp_gpu.py", "mnist_ddp_resume.py", {"train", "check_setup", "parse_args"},
     MNIST_SHARED | {"evaluate", "worker", "launch", "check_device", "roll_call", "attempt_store",
                     "prepare_in_turns", "Parser", "spawn_workers", "spawned_worker", "main"}),
    ("mnist_ddp_gpu.py", "mnist_ddp_comm.py", {"train", "build_model", "parse_args"},
     (MNIST_SHARED - {"build_model"}) | {"evaluate", "worker", "launch", "check_device", "check_setup",
                                         "roll_call", "attempt_store", "prepare_in_turns", "Parser",
                                         "spawn_workers", "spawned_worker", "main"}),
    ("mnist_ddp_gpu.py", "gcn_ddp.py", {"evaluate", "train", "worker", "launch", "check_device",
                                         "parse_args"},
     {"free_port", "Parser", "positive", "cpu_cores", "main", "UsageError", "prepare_in_turns",
      "roll_call", "attempt_store", "check_setup", "spawn_workers", "spawned_worker",
      "check_writable"}),
]


def top_level(path):
    tree = ast.parse(path.read_text())
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = ast.dump(node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            for target in node.targets:
                defs[target.id] = ast.dump(node.value)
    return defs


@pytest.mark.parametrize("earlier, script, lesson_specific, must_share", PAIRS, ids=[p[1] for p in PAIRS])
def test_shared_definitions_are_identical(earlier, script, lesson_specific, must_share):
    base, other = top_level(SCRIPTS / earlier), top_level(SCRIPTS / script)
    shared = (set(base) & set(other)) - lesson_specific
    assert must_share <= shared
    drifted = sorted(name for name in shared if base[name] != other[name])
    assert not drifted, f"{script} differs from {earlier} in {drifted}: change both"


def test_every_script_is_checked():
    assert {p.name for p in SCRIPTS.glob("*.py")} == {name for pair in PAIRS for name in pair[:2]}


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_scripts_import_only_what_a_copy_can_rely_on(script):
    allowed = {"torch", "torchvision", "tqdm", "torch_geometric"}
    stdlib = {"argparse", "gzip", "json", "os", "shutil", "socket", "sys", "time", "datetime",
              "urllib", "math", "random", "contextlib", "functools", "pathlib", "signal", "warnings",
              "ctypes", "threading", "struct", "traceback", "logging"}
    allowed |= {"ogb"} if script == "gcn_ddp.py" else set()
    tree = ast.parse((SCRIPTS / script).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots <= allowed | stdlib, roots - allowed - stdlib
