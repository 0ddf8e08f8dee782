"""Under torchrun every rank refuses; one of them says so (it was one line from each rank). With
torchrun --max-restarts, every attempt is refused; only the first says so."""
import time

import pytest
from helpers import LIMIT_S, run_script, torchrun


@pytest.mark.parametrize("script, args, expected, restarts", [
    ("mnist_ddp_cpu.py", ["--epochs", "0"], "--epochs", 2),  # the parser (through the roll call)
    ("mnist_ddp_gpu.py", ["--device", "cpu", "--amp", "fp16"], "--amp fp16 is for GPUs", 0),  # a check
])
def test_under_torchrun_a_refusal_is_said_once(script, args, expected, restarts):
    start = time.monotonic()
    launcher = [*torchrun(2), "--max-restarts", str(restarts)]
    r = run_script(script, *args, launcher=launcher, timeout=LIMIT_S + 30)
    assert r.returncode != 0 and time.monotonic() - start < LIMIT_S
    lines = [line for line in r.stderr.splitlines() if line.startswith(f"{script}: error:")]
    assert len(lines) == 1 and expected in lines[0], r.stderr
    assert "]: Traceback" not in r.stderr
