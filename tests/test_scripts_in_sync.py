"""The scripts are self-contained copies, so the parts they share must not drift apart:
every top-level definition with the same name is identical, except the ones each lesson changes."""
import ast

import pytest
from conftest import SCRIPTS

BASELINE = "mnist_single.py"
# What a lesson is allowed to change (the diff between the scripts is the lesson itself).
LESSON_SPECIFIC = {"evaluate", "train", "parse_args", "main"}


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


@pytest.mark.parametrize("script", ["mnist_ddp_cpu.py"])
def test_shared_definitions_are_identical(script):
    base, other = top_level(SCRIPTS / BASELINE), top_level(SCRIPTS / script)
    shared = (set(base) & set(other)) - LESSON_SPECIFIC
    assert {"prepare_data", "load_split", "ConvNet", "build_model"} <= shared
    drifted = sorted(name for name in shared if base[name] != other[name])
    assert not drifted, f"{script} differs from {BASELINE} in {drifted}: change both"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_scripts_import_only_what_a_copy_can_rely_on(script):
    allowed = {"torch", "torchvision", "tqdm", "torch_geometric"}
    stdlib = {"argparse", "gzip", "json", "os", "shutil", "socket", "sys", "time", "datetime",
              "urllib", "math", "random", "contextlib", "functools", "pathlib", "signal", "warnings"}
    tree = ast.parse((SCRIPTS / script).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots <= allowed | stdlib, roots - allowed - stdlib
