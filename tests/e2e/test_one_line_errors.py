"""Every script, launched as a user would with a mistake in its command line: one line on stderr,
no traceback, a non-zero exit, within seconds. (tests/unit/test_refusals.py checks the many
refusals in-process; this is what only a real process shows.)"""
import pytest
from helpers import MODULES, SCRIPTS, refused

pytestmark = pytest.mark.slow  # left out of make test-quick

MISTAKES = {
    "mnist_single.py": ["--batch-size", "-8"],
    "mnist_ddp_cpu.py": ["--epoch", "3"],  # an abbreviation: refused, not read as --epochs
    "mnist_ddp_gpu.py": ["--backend", "gloo", "--device", "cpu", "--nprocs", "0"],
    "mnist_ddp_resume.py": ["--crash-in-epoch", "1", "--epochs", "3"],
    "mnist_ddp_comm.py": ["--accum-steps", "0"],
    "mnist_ddp_debug.py": ["--bug", "segfault"],
    "mnist_ddp_practice.py": ["--model", "linear", "--batchnorm", "sync"],  # bnnet's flag
    "mnist_fsdp.py": ["--backend", "gloo", "--device", "cpu", "--amp", "fp16"],
    "gcn_single.py": ["--dropout", "1"],
    "gcn_ddp.py": ["--num-neighbors", "ten"],
    "mnist_by_hand.py": ["--sync", "ring"],
    "allreduce_by_hand.py": ["--mode", "x"],
    "sharding_by_hand.py": ["--shard", "zero4"],
    "mnist_model_parallel.py": ["--mode", "tp", "--nprocs", "3", "--width", "64"],
    "template_ddp.py": ["--lr", "-1"],
    "plan_parallelism.py": ["--layers", "32", "--hidden", "4096", "--heads", "30"],  # 4096 / 30 heads
}


def test_every_script_has_its_mistake():
    assert set(MISTAKES) == {p.name for p in SCRIPTS.glob("*.py")} - MODULES


@pytest.mark.parametrize("script", sorted(MISTAKES))
def test_a_mistake_is_one_line_without_a_traceback(script, data_args):
    data = [] if script.startswith(("gcn", "template", "allreduce", "plan")) else ["--data-dir", data_args[3]]
    assert "error" in refused(script, *MISTAKES[script], *data)
