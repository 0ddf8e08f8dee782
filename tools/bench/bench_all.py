"""make bench: every benchmark of the course in turn, each saying where it stands ("[2/4] ..."), on
THIS machine. Each writes its numbers under build/bench/ and redraws its figure; copy what you keep
into docs/MEASURED.md with the machine and the date.

    python tools/bench/bench_all.py [NAME ...]     # all, or only those named (e.g. startup gcn)
"""
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
BENCHMARKS = [  # (name, script and its flags, what it measures)
    ("startup", "bench/bench_startup.py", "what a short job pays before its first step"),
    ("cpu", "bench/bench.py", "lesson 6: 1 process against N on the CPU, threads"),
    ("comm", "bench/bench_comm.py", "lesson 6: communicating less"),
    ("allreduce", "figures/draw_allreduce_cost.py", "lesson 9: the ring all-reduce by hand against Gloo's"),
    ("by-hand", "bench/bench_by_hand.py", "lesson 9: each way of averaging the gradients against DDP"),
    ("trace", "figures/draw_overlap_trace.py",
     "lesson 9: one step of rank 0 in a profiler trace, by hand and DDP"),
    ("pipeline", "figures/draw_pipeline_schedules.py",
     "lesson 11: one step of GPipe and 1F1B, each stage's forwards and backwards in time"),
    ("pipeline-steps", "bench/bench_pipeline.py", "lesson 11: the pipeline's step against its micro-batches"),
    ("gcn", "bench/bench_gcn.py", "lesson 4: the GCN, 1 rank against 2"),
    ("fsdp", "bench/bench_fsdp.py", "sharding: memory per rank and time per step, ZeRO and FSDP against DDP"),
    ("netlab", "bench/bench_netlab.py",
     "lessons 6, 9 and 10 across two lab hosts at several link speeds (root only)"),
    ("netlab-allreduce", "bench/bench_netlab.py --all-reduce-only",
     "lesson 13: Gloo's all-reduce back to back across the lab, the planner's check (root only)"),
]
SKIPPED = 77  # a benchmark's exit code when this machine cannot run it (it says why)


def main():
    chosen = [b for b in BENCHMARKS if not sys.argv[1:] or b[0] in sys.argv[1:]]
    if not chosen:
        sys.exit(f"bench_all: no benchmark named {' '.join(sys.argv[1:])}; "
                 f"choose from {', '.join(b[0] for b in BENCHMARKS)}")
    failed, skipped, start = [], [], time.monotonic()
    for number, (name, script, what) in enumerate(chosen, 1):
        print(f"\n[{number}/{len(chosen)}] {name}: {what} (tools/{script}; {len(chosen) - number} after it)",
              flush=True)
        path, *flags = script.split()
        code = subprocess.run([sys.executable, str(TOOLS / path), *flags]).returncode
        if code == SKIPPED:
            skipped.append(name)
        elif code != 0:
            failed.append(name)
    done = len(chosen) - len(failed) - len(skipped)
    print(f"\nmake bench: {done} of {len(chosen)} benchmarks done in {(time.monotonic() - start) / 60:.0f} "
          f"minutes" + (f"; skipped here: {', '.join(skipped)}" if skipped else ""))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
