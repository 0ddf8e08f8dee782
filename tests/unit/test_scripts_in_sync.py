"""The scripts are self-contained copies, so the parts they share must not drift apart:
every top-level definition with the same name is identical, except the ones each lesson changes."""
import ast

import pytest
from helpers import SCRIPTS

MNIST_SHARED = {"prepare_data", "read_idx", "load_split", "ConvNet", "build_model", "Parser",
                "positive", "cpu_cores", "check_writable", "UsageError"}
# (earlier lesson, next lesson, what the next lesson may change, what it must share): the diff of
# their lesson parts is the lesson itself. The hardening below the fence is the same block in every
# DDP script (tests/unit/test_lesson_parts.py).
PAIRS = [
    ("mnist_single.py", "mnist_ddp_cpu.py", {"evaluate", "train", "parse_args", "main"}, MNIST_SHARED),
    ("mnist_ddp_cpu.py", "mnist_ddp_gpu.py", {"evaluate", "train", "worker", "check_setup", "parse_args"},
     MNIST_SHARED | {"main", "free_port"}),
    ("mnist_ddp_cpu.py", "mnist_by_hand.py", {"worker", "parse_args", "main", "build_model"},
     {"raw_dir", "read_idx", "load_split", "ConvNet", "Parser", "positive", "UsageError",
      "free_port", "FOLDERS", "MEAN_STD"}),
    ("mnist_ddp_comm.py", "mnist_by_hand.py", {"worker", "parse_args", "main"}, {"build_model"}),  # the MLP
    ("mnist_by_hand.py", "mnist_model_parallel.py", {"worker", "build_model", "parse_args"},
     {"FOLDERS", "MEAN_STD", "UsageError", "raw_dir", "read_idx", "load_split", "free_port", "Parser",
      "positive", "main"}),
    ("mnist_ddp_cpu.py", "mnist_ddp_debug.py", {"train", "parse_args"},
     MNIST_SHARED | {"evaluate", "worker", "main", "check_setup", "free_port"}),
    ("mnist_ddp_gpu.py", "mnist_ddp_resume.py", {"train", "check_setup", "parse_args"},
     MNIST_SHARED | {"evaluate", "worker", "main", "check_device", "free_port"}),
    ("mnist_ddp_gpu.py", "mnist_ddp_comm.py", {"train", "build_model", "parse_args"},
     (MNIST_SHARED - {"build_model"}) | {"evaluate", "worker", "main", "check_device", "check_setup"}),
    # Sharding: lesson 3 with --shard ddp|zero|fsdp and AdamW; lesson 6's MLP, the same definition.
    ("mnist_ddp_gpu.py", "mnist_fsdp.py", {"evaluate", "train", "build_model", "check_setup", "parse_args"},
     (MNIST_SHARED - {"build_model"}) | {"worker", "main", "check_device", "free_port", "write_metrics"}),
    ("mnist_ddp_comm.py", "mnist_fsdp.py", {"evaluate", "train", "check_setup", "parse_args"},
     {"build_model"}),
    ("gcn_single.py", "gcn_ddp.py",
     {"evaluate", "train", "main", "check_device", "parse_args", "load_dataset", "neighbor_loader"},
     {"synthetic_graph", "amazon_products", "have_amazon_products", "ogbn_products", "have_ogbn_products",
      "sort_edges", "eval_subset", "GCN", "loss_fn", "metric_sums", "metric_value", "check_sampler",
      "fan_outs", "worker_count", "probability", "Parser", "positive", "cpu_cores", "check_writable",
      "UsageError", "PROCESSED", "SAMPLER_HELP"}),
    ("mnist_ddp_gpu.py", "gcn_ddp.py", {"evaluate", "train", "worker", "main", "check_device", "parse_args"},
     {"free_port", "Parser", "positive", "cpu_cores", "UsageError", "check_setup", "check_writable"}),
    # The all-reduce by hand ("DDP from the inside"): the by-hand script's launching and command line.
    ("mnist_by_hand.py", "allreduce_by_hand.py", {"worker", "parse_args"},
     {"free_port", "Parser", "positive", "UsageError", "main"}),
    # The template: lesson 3's launching and command line around a project's own functions.
    ("mnist_ddp_gpu.py", "template_ddp.py",
     {"evaluate", "train", "worker", "main", "check_device", "check_setup", "parse_args", "build_model",
      "prepare_data", "UsageError"},
     {"free_port", "Parser", "positive", "cpu_cores", "check_writable", "write_metrics"}),
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
              "ctypes", "threading", "struct", "traceback", "logging", "re", "uuid", "gc", "statistics",
              "resource", "atexit"}
    allowed |= {"ogb"} if script.startswith("gcn_") else set()
    tree = ast.parse((SCRIPTS / script).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots <= allowed | stdlib, roots - allowed - stdlib
