"""Execute every course notebook with papermill, as a user's CI would, into build/notebooks/.

    python tools/generate/run_notebooks.py            # full runs
    python tools/generate/run_notebooks.py --smoke    # SMOKE=True: a few steps a run (the lessons: 11 min)
    python tools/generate/run_notebooks.py notebooks/02_ddp_cpu_gloo.ipynb
    python tools/generate/run_notebooks.py --smoke --record-times notebooks/[0-9]*.ipynb
        # each lesson's smoke time into docs/measured/smoke_times.json (`make times` writes it in)

Each notebook runs with notebooks/ as its working directory (as Jupyter and nbmake do).
"""
import argparse
import sys
import time
from pathlib import Path

import compute_times
import papermill
from kernels import UnixSocketKernelManager

REPO = Path(__file__).resolve().parents[2]


def execute(nb, out, smoke):
    """Run one notebook with papermill into `out`, with SMOKE set, from the notebook's own folder (as
    Jupyter and nbmake do). Raises papermill.PapermillExecutionError if a cell fails."""
    papermill.execute_notebook(str(nb), str(out), cwd=str(Path(nb).parent), parameters={"SMOKE": smoke},
                               kernel_name="python3", progress_bar=False, execution_timeout=1800,
                               kernel_manager_class=UnixSocketKernelManager)  # (kernels.py says why)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--smoke", action="store_true", help="run with SMOKE=True")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "notebooks")
    parser.add_argument("--record-times", action="store_true", help="with --smoke: record each lesson's "
                        "time in docs/measured/smoke_times.json (compute_times.py)")
    args = parser.parse_args()
    if args.record_times and not args.smoke:
        parser.error("--record-times records smoke-mode times: add --smoke")
    notebooks = args.notebooks or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)
    failed, seconds = [], {}
    for number, nb in enumerate(notebooks, 1):
        nb = nb.resolve()
        start = time.perf_counter()
        shown = nb.relative_to(REPO) if nb.is_relative_to(REPO) else nb
        print(f"[{number}/{len(notebooks)}] running {shown} (SMOKE={args.smoke}; {len(notebooks) - number} "
              f"after it) ...", flush=True)
        try:
            execute(nb, args.out / nb.name, args.smoke)
        except papermill.PapermillExecutionError as err:
            failed.append(nb.name)
            print(f"  FAILED in cell {err.exec_count}: {err.ename}: {err.evalue}", flush=True)
            continue
        seconds[nb.stem] = time.perf_counter() - start
        print(f"  ok in {seconds[nb.stem]:.0f} s -> {args.out / nb.name}", flush=True)
    if args.record_times:
        lessons = {lesson.stem for lesson in compute_times.lessons()}
        compute_times.record_smoke({stem: s for stem, s in seconds.items() if stem in lessons})
        print(f"recorded the lessons' smoke times in {compute_times.SMOKE_TIMES.relative_to(REPO)}")
    if failed:
        sys.exit(f"{len(failed)} notebook(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
