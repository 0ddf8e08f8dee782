"""GPU check for lessons 3 and 4, a few minutes on whatever GPUs are present (make gpu-check).

Runs ddp_scripts/mnist_ddp_gpu.py for one epoch of the ConvNet with NCCL: on 1 GPU, and on 2 when
there are two or more, each with --amp off, bf16 and fp16; checks the test accuracy and prints
images/s. Then, when PyG and its sampler are installed, ddp_scripts/gcn_ddp.py the same way (100
steps on a synthetic graph, sampled nodes/s); otherwise it says why lesson 4 was skipped.
Exits non-zero when a run fails or learns too little, or when no GPU is visible.

    python tools/gpu/gpu_check.py [--data-dir data] [--epochs 1]

On a machine without internet, the data must already be in --data-dir (MNIST or Fashion-MNIST in
torchvision's layout; `make setup` prepares Fashion-MNIST where Debian's package is available).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# Test accuracy one epoch of the ConvNet must reach (it reaches about 0.98 and 0.85 on CPU).
MIN_ACCURACY = {"mnist": 0.95, "fashion-mnist": 0.80}


@dataclass
class Lesson:
    name: str
    script: str
    args: list  # besides --nprocs and --amp
    accuracy_key: str  # in each epoch of the metrics JSON
    rate_key: str
    unit: str
    min_accuracy: float


def mnist_lesson(dataset, args):
    return Lesson("lesson 3", "mnist_ddp_gpu.py",
                  ["--epochs", str(args.epochs), "--dataset", dataset, "--data-dir", args.data_dir],
                  "test_accuracy", "images_per_second", "images/s", MIN_ACCURACY[dataset])


# 100 steps on the synthetic graph (16 classes) reach about 0.95 test accuracy on CPU. Sampling
# workers as recommended on GPUs: forked by ranks that already hold a CUDA context.
GCN_LESSON = Lesson("lesson 4", "gcn_ddp.py", ["--dataset", "synthetic", "--num-nodes", "100000",
                                               "--max-steps", "100", "--eval-nodes", "5000",
                                               "--num-workers", "2"],
                    "test_metric", "sampled_nodes_per_second", "sampled nodes/s", 0.6)


def run(nprocs, amp, lesson):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [sys.executable, str(REPO / "ddp_scripts" / lesson.script), "--nprocs", str(nprocs),
               "--amp", amp, *lesson.args, "--quiet", "--metrics-json", str(metrics)]
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            return {"ok": False, "error": (result.stderr.strip().splitlines() or ["?"])[-1], "wall": wall}
        epoch = json.loads(metrics.read_text())["epochs"][-1]
        accuracy = epoch[lesson.accuracy_key]
        return {"ok": accuracy >= lesson.min_accuracy, "wall": wall, "accuracy": accuracy,
                "rate": epoch[lesson.rate_key]}


def sampler_missing():
    """Why lesson 4 cannot run here, or None."""
    try:
        import torch_geometric.typing as pyg_typing
    except ImportError:
        return "torch_geometric is not installed"
    if not (pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE):
        return "neither pyg-lib nor torch-sparse is installed (NeighborLoader needs one)"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lesson", type=int, choices=[3, 4], action="append",
                        help="only this lesson (repeatable; default: 3 and 4)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        sys.exit("gpu-check: no CUDA device is visible here (nvidia-smi, CUDA_VISIBLE_DEVICES); "
                 "the CPU parts of lessons 3 and 4 are covered by make test")

    wanted = set(args.lesson or [3, 4])
    lessons, dataset = [], None
    if 3 in wanted:
        sys.path.insert(0, str(REPO / "ddp_scripts"))
        import mnist_parts

        dataset = mnist_parts.prepare_data("auto", args.data_dir, verbose=False)
        lessons.append(mnist_lesson(dataset, args))
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    print(f"gpu-check: {gpus} GPU(s): {names}; torch {torch.__version__}"
          + (f"; dataset {dataset}" if dataset else ""), flush=True)
    worlds = [1, 2] if gpus >= 2 else [1]
    amps = ["off", "bf16", "fp16"] if torch.cuda.get_device_capability(0) >= (8, 0) else ["off", "fp16"]
    results = {}
    if 4 in wanted:
        missing = sampler_missing()
        if not missing:
            lessons.append(GCN_LESSON)
        elif wanted == {4}:  # asked for lesson 4 alone: not running it is a failure
            sys.exit(f"gpu-check: lesson 4 cannot run: {missing}")
        else:
            print(f"  lesson 4 (GCN) skipped: {missing}", flush=True)
    for lesson in lessons:
        for world in worlds:
            for amp in amps:
                r = results[(lesson.name, world, amp)] = run(world, amp, lesson)
                status = "ok  " if r["ok"] else "FAIL"
                detail = (f"accuracy {r['accuracy']:.2%}, {r['rate']:>9,.0f} {lesson.unit}"
                          if "accuracy" in r else r["error"])
                print(f"  {status} {lesson.name}, {world} GPU(s), amp {amp:<4}  {detail}  "
                      f"({r['wall']:.0f} s with start-up)", flush=True)
        one, two = results[(lesson.name, 1, "off")], results.get((lesson.name, 2, "off"))
        if two and one["ok"] and two["ok"]:
            print(f"  {lesson.name}: 2 GPUs vs 1 GPU (amp off): {two['rate'] / one['rate']:.2f}x "
                  f"{lesson.unit}")
    failed = [k for k, r in results.items() if not r["ok"]]
    if failed:
        sys.exit(f"gpu-check: {len(failed)} run(s) failed: {failed}")
    print("gpu-check: all runs passed")


if __name__ == "__main__":
    main()
