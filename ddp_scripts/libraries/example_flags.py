"""The flags of both library examples (with_accelerate.py, with_fabric.py), written once: the test
runs them alike, and their diff shows only what each library changes."""
import argparse
from pathlib import Path


def parse_args(description, argv=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--model", default="linear", choices=["linear", "convnet", "mlp"])
    p.add_argument("--batch-size", type=int, default=64, help="the global batch, all ranks together")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--eval-images", type=int, default=10_000, help="test images scored")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "data"))
    p.add_argument("--metrics-json", help="write the evaluation's counts here")
    p.add_argument("--save", help="write the trained model's state_dict here")
    args = p.parse_args(argv)
    if args.batch_size % (args.accum * args.nprocs):
        p.error(f"--batch-size {args.batch_size} must divide into --accum x --nprocs equal shares")
    return args
