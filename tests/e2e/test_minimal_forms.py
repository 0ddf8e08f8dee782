"""Each DDP script's minimal form (ddp_scripts/minimal/, written by make minimal: the lesson part
alone, plain mp.spawn and plain errors) trains exactly as the full script: the same weights after
a few steps on 2 CPU ranks, and it runs under torchrun too."""
import pytest
import torch
from helpers import max_abs_diff, needs_sampler, run_script, torchrun

pytestmark = pytest.mark.slow  # left out of make test-quick


# Each full script and its minimal form, a few steps on 2 CPU ranks, the same flags.
RUNS = {
    "mnist_ddp_cpu.py": ["--model", "convnet", "--max-steps", 4],
    "mnist_ddp_gpu.py": ["--backend", "gloo", "--device", "cpu", "--model", "convnet", "--max-steps", 4],
    "mnist_ddp_resume.py": ["--backend", "gloo", "--device", "cpu", "--model", "convnet", "--max-steps", 4],
    "mnist_ddp_comm.py": ["--backend", "gloo", "--device", "cpu", "--model", "linear", "--accum-steps", 2,
                          "--max-steps", 4],
    "mnist_ddp_debug.py": ["--model", "linear", "--check-sync-every", 2, "--max-steps", 4],
    "mnist_fsdp.py": ["--backend", "gloo", "--device", "cpu", "--model", "linear", "--max-steps", 4],
    "gcn_ddp.py": ["--device", "cpu", "--num-nodes", 2000, "--eval-nodes", 200, "--max-steps", 3],
    "template_ddp.py": ["--max-steps", 6],
}


@pytest.mark.parametrize("script", sorted(RUNS), ids=sorted(RUNS))
def test_the_minimal_form_trains_exactly_as_the_full_script(tmp_path, data_args, script):
    if script == "gcn_ddp.py":
        needs_sampler()
    data = [] if script in ("gcn_ddp.py", "template_ddp.py") else data_args
    extra = ["--snapshot", tmp_path / "snapshot.pt"] if script == "mnist_ddp_resume.py" else []
    weights = {}
    for form in (script, f"minimal/{script}"):
        path = tmp_path / f"{form.replace('/', '-')}.pt"
        r = run_script(form, "--nprocs", 2, *RUNS[script], *extra, "--quiet", "--save", path, *data,
                       timeout=180)
        assert r.returncode == 0, r.stderr
        assert "done:" in r.stdout
        weights[form] = torch.load(path)
    full, minimal = weights.values()
    assert max_abs_diff(full, minimal) == 0


def test_the_minimal_form_runs_under_torchrun(tmp_path, data_args):
    path = tmp_path / "weights.pt"
    r = run_script("minimal/mnist_ddp_cpu.py", "--model", "linear", "--max-steps", 3, "--quiet",
                   "--save", path, *data_args, launcher=torchrun(2), timeout=180)
    assert r.returncode == 0, r.stderr
    assert path.stat().st_size > 0
