"""Generate kaggle/ddp_t4x2.ipynb from the repository's own scripts (make kaggle).

The Kaggle notebook embeds each script of ddp_scripts/ in a %%writefile cell, so that it runs the
very code the course teaches. Never edit the notebook by hand: edit the scripts or this file, then
`make kaggle`. `--check` exits non-zero when the committed notebook is out of date (a test runs it).
"""
import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "kaggle" / "ddp_t4x2.ipynb"
# Each file once: the modules the scripts import, then the scripts.
SCRIPTS = ["ddp_hardening.py", "mnist_parts.py", "gcn_parts.py", "mnist_single.py", "mnist_ddp_cpu.py",
           "mnist_ddp_gpu.py", "mnist_ddp_resume.py", "mnist_ddp_comm.py", "mnist_fsdp.py", "gcn_ddp.py"]

INTRO = """\
# PyTorch DDP on Kaggle's two T4 GPUs

Lessons 2 to 6 and 10 of the course on Kaggle's **GPU T4 x2** accelerator: DDP on CPU with Gloo, then
on one and two GPUs with NCCL, timed side by side; a job that loses a GPU's rank halfway and
resumes from its snapshot (lesson 5); what the gradient all-reduce costs between two GPUs on PCIe,
and gradient accumulation and fp16 compression against it (lesson 6); what each GPU holds when the
training state is sharded, ZeRO and FSDP against DDP (lesson 10); then a GCN on OGB's
ogbn-products graph (2.4 million nodes) with PyG's `NeighborLoader` (lesson 4, last because it
takes longest).

Before running: in the notebook's settings (right-hand panel), choose **Accelerator: GPU T4 x2**
and switch **Internet on** (MNIST and ogbn-products, 1.4 GB, are downloaded once). Then *Run all*.
Lessons 2, 3, 5, 6 and 10 are short MNIST runs; lesson 4 takes longest (the download, the
processing, and the install of PyG's sampler if no prebuilt wheel matches the image's torch). No
times are given: this notebook has not been timed on Kaggle yet.

**Where this has run.** The scripts are the course's own, tested on CPUs (every lesson) and on a
machine with one GPU (lessons 3, 4 and 6; lesson 5 only before it gained `--deterministic`, which
its cells here use; lesson 10 on CPUs only). Two GPUs, and this notebook as a whole,
have not been run yet, on Kaggle or elsewhere: if you run it, please report what you see.

The data goes to `/tmp`, not to `/kaggle/working`: Kaggle keeps everything under
`/kaggle/working` as the notebook's output, and ogbn-products alone takes several GB there."""

CHECK_GPUS = """\
import subprocess, sys
import torch

print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout or "nvidia-smi: no GPU")
GPUS = torch.cuda.device_count()
print(f"torch {torch.__version__}, {GPUS} GPU(s) visible")
if GPUS < 2:
    raise SystemExit("This notebook needs two GPUs: "
                     "Settings -> Accelerator -> 'GPU T4 x2', then run again.")
for i in range(GPUS):  # e.g. a P100 (sm_60), for which this image's torch may have no kernels
    major, minor = torch.cuda.get_device_capability(i)
    if f"sm_{major}{minor}" not in torch.cuda.get_arch_list():
        raise SystemExit(f"torch {torch.__version__} has no kernels for {torch.cuda.get_device_name(i)} "
                         f"(sm_{major}{minor}): Settings -> Accelerator -> 'GPU T4 x2', then run again.")"""

INSTALL = """\
# Kaggle's image ships torch and torchvision: install only what is missing, never torch itself.
import importlib.util
missing = [name for name in ("torchvision", "tqdm") if importlib.util.find_spec(name) is None]
if missing and subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing]).returncode:
    raise SystemExit(f"pip could not install {missing}: is Internet on (Settings -> Internet)?")
print("missing packages installed:", missing or "none")"""

RUN_HELPER = """\
import json, os, shlex

def run(*args):
    \"\"\"Run `python <args>` and stream its output here (spawned processes need a file to import).\"\"\"
    argv = [str(a) for a in args]
    print("$ python " + " ".join(shlex.quote(a) for a in argv), flush=True)
    with subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
    if proc.returncode:
        raise RuntimeError(f"exit code {proc.returncode}")

EPOCHS = 3
DATA = "/tmp/ddp-course-data"  # not in /kaggle/working, which Kaggle keeps as the notebook's output
# prepare (download) the data once, before any run starts processes
run("-c", f"import mnist_parts; print(mnist_parts.prepare_data('auto', {DATA!r}))")"""

SCRIPTS_INTRO = """\
## The course's scripts

The next cells write the course's files (`ddp_scripts/` in the repository, generated from them by
`tools/generate/build_kaggle_notebook.py`) to the working directory, each once: the modules the scripts
import (`ddp_hardening.py`, what keeps a job safe on a cluster; `mnist_parts.py` and
`gcn_parts.py`, the data and models), then the lessons' scripts. Their code is collapsed: expand a
cell to read a file."""

# Collapsed code: Kaggle's editor reads _kg_hide-input, JupyterLab source_hidden.
HIDDEN = {"_kg_hide-input": True, "jupyter": {"source_hidden": True}}

LESSON2 = """\
## Lesson 2 on Kaggle's CPUs: Gloo

The machine has 4 CPU threads; two processes of two threads each."""

LESSON3 = """\
## Lesson 3: NCCL on one GPU, then on two

`mnist_ddp_gpu.py` starts one process per GPU (`--nprocs`), pins each to its GPU with
`torch.cuda.set_device(local_rank)` and keeps the (small) dataset on the GPU. The T4 has no native
bf16 (torch emulates it, slowly), so mixed precision here is `--amp fp16` (with a gradient scaler).
Two T4s talk over PCIe; if NCCL ever hangs at start-up on such a box, `NCCL_P2P_DISABLE=1` is the
usual remedy and `NCCL_DEBUG=INFO` shows what it chose."""

GPU_RUNS = """\
results = {}
for nprocs in (1, 2):
    for amp in ("off", "fp16"):
        path = f"gpu{nprocs}_{amp}.json"
        run("mnist_ddp_gpu.py", "--nprocs", nprocs, "--amp", amp, "--epochs", EPOCHS,
            "--data-dir", DATA, "--metrics-json", path)
        results[(nprocs, amp)] = json.load(open(path))["epochs"]
        print()"""

TORCHRUN = """\
# the same script under torchrun, which starts the two processes itself
run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, "mnist_ddp_gpu.py",
    "--epochs", 1, "--data-dir", DATA)"""

TABLE = """\
from IPython.display import Markdown

def row(nprocs, amp):
    last = results[(nprocs, amp)][-1]
    ips = sum(e["images_per_second"] for e in results[(nprocs, amp)][1:]) / max(1, EPOCHS - 1)
    return f"| {nprocs} | {amp} | {ips:,.0f} | {last['test_accuracy']:.2%} |"

base = sum(e["images_per_second"] for e in results[(1, "off")][1:]) / max(1, EPOCHS - 1)
two = sum(e["images_per_second"] for e in results[(2, "off")][1:]) / max(1, EPOCHS - 1)
Markdown("| GPUs | amp | images/s (epochs after the first) | test accuracy |\\n|---|---|---|---|\\n"
         + "\\n".join(row(n, a) for n in (1, 2) for a in ("off", "fp16"))
         + f"\\n\\nTwo T4s against one, amp off: **{two / base:.2f}x** the images per second, measured "
           "in this run. The first epoch is left out: it includes CUDA's start-up.")"""

LESSON5 = """\
## Lesson 5: a crash on two GPUs, a torchrun restart, and the resumed job

`mnist_ddp_resume.py` is lesson 3's script with a snapshot after every epoch (weights, optimizer,
gradient scaler, every rank's random state, progress). `--crash-in-epoch 2` kills the last rank
halfway through epoch 2; `torchrun --max-restarts 1` starts both ranks again, and they resume from
the snapshot of epoch 1. Then the same training without the crash, and the two models compared.
Both runs ask for `--deterministic` kernels: without them, two identical GPU runs end with
different weights (measured on an H200: up to 0.14 apart after 2 epochs; cuDNN and cuBLAS may add
in an order that varies from run to run), and the comparison could not tell a faithful resume from
a faulty one. That the flag makes the two runs equal bit for bit on a GPU has not been measured
yet: this run is such a measurement."""

RESUME_RUNS = r'''
for path in ("snapshot.pt", "snapshot_clean.pt"):
    if os.path.exists(path):
        os.remove(path)  # start afresh each time the notebook runs
run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, "--max-restarts", 1,
    "mnist_ddp_resume.py", "--epochs", 3, "--crash-in-epoch", 2, "--deterministic", "--data-dir", DATA,
    "--snapshot", "snapshot.pt", "--save", "resumed.pt")
print()
run("mnist_ddp_resume.py", "--nprocs", 2, "--epochs", 3, "--deterministic", "--data-dir", DATA,
    "--snapshot", "snapshot_clean.pt", "--save", "uninterrupted.pt")
a, b = torch.load("resumed.pt"), torch.load("uninterrupted.pt")
difference = max((a[k] - b[k]).abs().max().item() for k in a)
Markdown(f"Largest difference between a weight of the resumed model and of the uninterrupted one: "
         f"**{difference:g}**. "
         + ("Equal to the last bit: weights, momentum and both ranks' dropout draws were restored."
            if difference == 0 else
            "Not equal: a GPU kernel was not repeatable after all, or something the next step depends "
            "on is missing from the snapshot."))'''.strip()

LESSON6 = """\
## Lesson 6: what the all-reduce costs between two T4s, and paying less for it

`mnist_ddp_comm.py` is lesson 3's script with gradient accumulation (`--accum-steps`: the gradients
are all-reduced once per K micro-batches, `model.no_sync()` for the others), compression hooks
(`--comm-hook fp16`: the gradients travel in half precision) and a wide MLP (`--model mlp`, 23 MB
of gradients per step, little arithmetic). The two T4s exchange gradients over PCIe, so this model
is bandwidth-bound: at start-up each run prints one all-reduce of its gradient size, timed alone.
Two epochs each; the table uses the second (the first includes CUDA's start-up)."""

COMM_RUNS = r'''
comm = {}
for name, nprocs, flags in [("1 GPU", 1, []), ("2 GPUs", 2, []),
                            ("1 GPU, --accum-steps 4", 1, ["--accum-steps", 4]),
                            ("2 GPUs, --accum-steps 4", 2, ["--accum-steps", 4]),
                            ("2 GPUs, --comm-hook fp16", 2, ["--comm-hook", "fp16"])]:
    path = f"comm_{len(comm)}.json"
    run("mnist_ddp_comm.py", "--nprocs", nprocs, "--model", "mlp", "--epochs", 2, "--quiet",
        "--data-dir", DATA, "--metrics-json", path, *flags)
    comm[name] = json.load(open(path))
ips = {name: m["epochs"][-1]["images_per_second"] for name, m in comm.items()}
baseline = {name: "1 GPU, --accum-steps 4" if "accum" in name else "1 GPU" for name in comm}
rows = [f"| {name} | {m['gradient_mb']:.1f} | {m['allreduce_ms']:.2f} | {ips[name]:,.0f} | "
        f"{ips[name] / ips[baseline[name]]:.2f}x |" for name, m in comm.items()]
Markdown("| run | MB per all-reduce | one all-reduce alone, ms | images/s (epoch 2) | vs 1 GPU, same K |\n"
         "|---|---|---|---|---|\n" + "\n".join(rows)
         + "\n\nMeasured in this run. Accumulation keeps every step's arithmetic and sends a quarter "
           "as often (its steps average 4x the images: a larger batch, which may need another "
           "learning rate); it is compared with 1 GPU at the same K, since fewer optimizer steps "
           "speed up one GPU too. The hook halves the bytes at the cost of rounding the averaged "
           "gradients to fp16.")'''.strip()

LESSON10 = """\
## Lesson 10: what each GPU holds under DDP, ZeRO and FSDP

`mnist_fsdp.py` is lesson 3's script with AdamW and `--shard`: `ddp` keeps the whole training state
on each GPU (weights, gradients, AdamW's two running averages: 16 bytes a parameter), `zero` splits
the optimizer's state across the ranks (`ZeroRedundancyOptimizer`), `fsdp` splits all of it
(`fully_shard` on each layer, then on the model; each layer's weights are gathered only while it
computes). Three short runs of lesson 6's MLP (5.8 million parameters) on the two GPUs, 20 steps in
the same unshuffled order: `state_mib_per_rank` counts the tensors each rank holds after a step,
from their local shards; the peak is CUDA's `max_memory_allocated`, which adds the activations and
the gathered layers. Each run saves the plain, gathered model, so that the table can also say how
far ZeRO's and FSDP's weights ended from DDP's."""

SHARD_RUNS = r'''
shards = {}
for shard in ("ddp", "zero", "fsdp"):
    run("mnist_fsdp.py", "--nprocs", 2, "--shard", shard, "--max-steps", 20, "--no-shuffle", "--quiet",
        "--data-dir", DATA, "--save", f"shard_{shard}.pt", "--metrics-json", f"shard_{shard}.json")
    shards[shard] = json.load(open(f"shard_{shard}.json"))
    print()
reference = torch.load("shard_ddp.pt")
rows = []
for shard, m in shards.items():
    weights = torch.load(f"shard_{shard}.pt")
    difference = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    rows.append(f"| {shard} | {' / '.join(f'{s:.1f}' for s in m['state_mib_per_rank'])} | "
                f"{max(m['state_mib_per_rank']) / max(shards['ddp']['state_mib_per_rank']):.2f}x | "
                f"{' / '.join(f'{p:.0f}' for p in m['peak_mib_per_rank'])} | {difference:.1e} |")
Markdown("| --shard | state per rank, MiB (rank 0 / 1) | vs ddp | peak per rank, MiB "
         "| weights vs ddp, largest difference |\n|---|---|---|---|---|\n" + "\n".join(rows)
         + "\n\nMeasured in this run. On two ranks FSDP should hold half of DDP's state; ZeRO splits "
           "AdamW's averages by whole tensors, largest first (the weights and gradients stay whole), "
           "so rank 0, with the 2048 x 2048 matrix, holds about 76 MiB and rank 1 57. The same 20 "
           "steps on CPU ranks "
           "end with DDP's weights to float rounding (the course's tests); on GPUs NCCL may add the "
           "gradients in another order in each mode. An AdamW step moves a weight by about the "
           "learning rate (0.001) at most: a difference well below it is rounding, one near it a "
           "step that went another way.")'''.strip()

LESSON4 = """\
## Lesson 4: a GCN on ogbn-products with NeighborLoader, on one GPU and on two

`gcn_ddp.py` (written above) samples two-hop neighbourhoods (`--num-neighbors 15,10`) of 512 seed
nodes per rank on the CPU and trains a two-layer GCN on the GPU; each rank takes an equal chunk of
the training nodes, and the graph is loaded once and shared by the ranks. PyG's sampler needs
`pyg-lib` (a prebuilt wheel from PyG's index, when one matches this image's torch and CUDA) or
`torch-sparse` (built from source otherwise: about 15 minutes, CPU-only, which is all the sampler
needs). The ogbn-products test split has 2.2 million nodes, so `--eval-nodes` scores a fixed random
50,000 of them (and of the validation nodes) each epoch."""

INSTALL_PYG = r'''
import importlib.util, re

def pip(*args):
    ok = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args]).returncode == 0
    importlib.invalidate_caches()  # let this kernel see what was just installed
    return ok

missing = [name for name in ("torch_geometric", "ogb") if importlib.util.find_spec(name) is None]
if missing and not pip(*missing):
    raise SystemExit(f"pip could not install {missing}: is Internet on (Settings -> Internet)?")
if not any(importlib.util.find_spec(name) for name in ("pyg_lib", "torch_sparse")):
    version = re.match(r"\d+\.\d+", torch.__version__).group(0)
    cuda = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    index = f"https://data.pyg.org/whl/torch-{version}.0+{cuda}.html"
    # pyg_lib is not on PyPI: only PyG's index, for exactly this torch and CUDA, has it
    if not pip("pyg_lib", "--no-index", "-f", index):
        print(f"no pyg_lib wheel at {index}: building torch-scatter and torch-sparse (CPU-only), "
              "about 15 minutes", flush=True)
        os.environ["FORCE_ONLY_CPU"] = "1"
        if not pip("--no-build-isolation", "torch-scatter", "torch-sparse"):
            raise SystemExit("no neighbour sampler: pyg_lib has no wheel for this image and "
                             "torch-sparse did not build (its error is above)")
print("sampler:", "pyg_lib" if importlib.util.find_spec("pyg_lib") else "torch_sparse")'''.strip()

PREPARE_GRAPH = r'''
# Download (1.4 GB) and process ogbn-products once, before any run starts processes. Then check
# /dev/shm, where mp.spawn's ranks share the graph (about 3 GB; Kaggle does not document its size):
# when it is too small, the ranks are started by torchrun instead, which map the graph from a file
# on disk, sample without worker processes (which hand their batches over through /dev/shm), and
# NCCL is told not to use shared memory between the GPUs' processes either.
run("-c", f"""
import json, gcn_ddp
data, split, _ = gcn_ddp.ogbn_products({DATA!r})
print(data)
try:
    gcn_ddp.check_shared_memory(data, split)
    short = None
except gcn_ddp.UsageError as err:
    short = str(err)
json.dump(short, open("shm.json", "w"))
""")
SHM_SHORT = json.load(open("shm.json"))
if SHM_SHORT:
    os.environ["NCCL_SHM_DISABLE"] = "1"
    print(f"/dev/shm is too small ({SHM_SHORT.split(': give')[0]}): the GCN runs under torchrun, "
          "the graph mapped from disk, no sampling workers, NCCL_SHM_DISABLE=1")
else:
    print("the graph fits in /dev/shm: the GCN's ranks share it there (mp.spawn)")'''.strip()

GCN_RUNS = r'''
gcn = {}
for nprocs in (1, 2):
    path = f"gcn{nprocs}.json"
    # Sampling workers hand each sampled batch (tens of MB) to their rank through /dev/shm: none
    # when it is too small, the rank samples itself.
    flags = ["--dataset", "ogbn-products", "--data-dir", DATA, "--epochs", 2, "--eval-nodes", 50000,
             "--num-workers", 0 if SHM_SHORT else 1, "--metrics-json", path]
    if SHM_SHORT:
        run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nprocs, "gcn_ddp.py", *flags)
    else:
        run("gcn_ddp.py", "--nprocs", nprocs, *flags)
    gcn[nprocs] = json.load(open(path))["epochs"]
    print()

rows = []
for nprocs, epochs in gcn.items():
    last = epochs[-1]  # the second epoch: the first includes start-up
    rows.append(f"| {nprocs} | {last['seconds']:.1f} | {last['sampled_nodes_per_second']:,.0f} | "
                f"{last['test_metric']:.2%} |")
ratio = gcn[2][-1]["sampled_nodes_per_second"] / gcn[1][-1]["sampled_nodes_per_second"]
Markdown("| GPUs | epoch s (second epoch) | sampled nodes/s | test accuracy (50,000 nodes) |\n"
         "|---|---|---|---|\n" + "\n".join(rows)
         + f"\n\nTwo T4s against one: **{ratio:.2f}x** the sampled nodes per second, measured in this "
           "run. The two ranks share the machine's four CPU threads for sampling, where this lesson "
           "spends most of its time.")'''.strip()


def build():
    cells = [new_markdown_cell(INTRO), new_code_cell(CHECK_GPUS), new_code_cell(INSTALL),
             new_markdown_cell(SCRIPTS_INTRO)]
    for name in SCRIPTS:
        source = (REPO / "ddp_scripts" / name).read_text()
        cell = new_code_cell(f"%%writefile {name}\n{source.rstrip()}")
        cell.metadata.update(HIDDEN)
        cells.append(cell)
    cells += [new_code_cell(RUN_HELPER), new_markdown_cell(LESSON2),
              new_code_cell('run("mnist_ddp_cpu.py", "--nprocs", 2, "--epochs", 1, "--data-dir", DATA)'),
              new_markdown_cell(LESSON3), new_code_cell(GPU_RUNS), new_code_cell(TORCHRUN),
              new_code_cell(TABLE), new_markdown_cell(LESSON5), new_code_cell(RESUME_RUNS),
              new_markdown_cell(LESSON6), new_code_cell(COMM_RUNS),
              new_markdown_cell(LESSON10), new_code_cell(SHARD_RUNS),
              new_markdown_cell(LESSON4), new_code_cell(INSTALL_PYG),
              new_code_cell(PREPARE_GRAPH), new_code_cell(GCN_RUNS)]
    nb = new_notebook(cells=cells)
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}, "accelerator": "GPU"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids: the same scripts give the same file
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed notebook is stale")
    args = parser.parse_args()
    text = build()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT.relative_to(REPO)} is out of date with ddp_scripts/: run `make kaggle`")
        print(f"{OUT.relative_to(REPO)} is up to date")
        return
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
