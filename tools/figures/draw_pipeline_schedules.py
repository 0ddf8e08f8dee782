"""Draw figures/pipeline_schedules.png: GPipe and 1F1B, each stage's forwards and backwards in time.

One training step of mnist_model_parallel.py --mode pp on 2 stages and 4 micro-batches, per panel:

    gpipe         --schedule gpipe          torch's ScheduleGPipe: every forward, then every backward
    1f1b          --schedule 1f1b           torch's Schedule1F1B: after a warm-up, one forward, one backward
    1f1b-by-hand  --schedule 1f1b-by-hand   the script's own 1F1B, plain sends and receives

The bars are the script's own timestamps (its --metrics-json "timeline": when each stage ran each
micro-batch's forward and backward, on a clock the processes of one machine share); the gaps are
the bubble, and the messages (sending, waiting, receiving). Lesson 11's MLP at width 512 (its two
stages then compute about as long as each other) and a global batch of 1,024 (micro-batches of 256,
so that the computation is long enough to see). Of the steps after the first, the fastest is drawn
(the least disturbed by whatever else the machine runs); the time axis is shared.

    python tools/figures/draw_pipeline_schedules.py [--out figures/pipeline_schedules.png]
"""
import argparse
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"
sys.path.insert(0, str(REPO / "tools" / "bench"))
from bench import cores, cpu_name, run_metrics  # noqa: E402

STAGES, MICRO, WIDTH, BATCH, STEPS = 2, 4, 512, 1024, 6
PANELS = {"gpipe": "GPipe (torch's ScheduleGPipe)", "1f1b": "1F1B (torch's Schedule1F1B)",
          "1f1b-by-hand": "1F1B by hand (mnist_model_parallel.py's one_f_one_b_by_hand)"}
COLOURS = {"F": "#8ab6d6", "B": "#e0803a"}


def run(schedule, data_args):
    """One run of the script with this schedule: its metrics (the timeline among them)."""
    flags = ["--mode", "pp", "--nprocs", STAGES, "--microbatches", MICRO, "--schedule", schedule, "--width",
             WIDTH, "--batch-size", BATCH, "--max-steps", STEPS, "--no-shuffle", "--quiet"]
    return run_metrics("mnist_model_parallel.py", list(map(str, flags)), data_args)


def fastest_step(timeline):
    """(step index, its events per stage, shifted to start at 0 ms), the fastest after the first."""
    def span(step):
        events = [e for stage in timeline for e in stage[step]]
        return max(e[3] for e in events) - min(e[2] for e in events)
    step = min(range(1, len(timeline[0])), key=span)
    start = min(e[2] for stage in timeline for e in stage[step])
    return step, [[(kind, mb, (b - start) * 1e3, (e - start) * 1e3) for kind, mb, b, e in stage[step]]
                  for stage in timeline]


def idle(stages):
    """Each stage's share of the step spent in neither a forward nor a backward (the script's measure)."""
    sys.path.insert(0, str(SCRIPTS))
    from mnist_model_parallel import idle_shares

    return idle_shares([[stage] for stage in stages])


def handovers(stages):
    """ms from the end of a micro-batch's forward (backward) on one stage to the start of its forward
    (backward) on the next stage (the one before): the message between them, and any wait for the
    receiving stage to be free."""
    at = [{(kind, mb): (b, e) for kind, mb, b, e in stage} for stage in stages]
    gaps = []
    for r in range(len(stages) - 1):
        for kind, mb in at[r]:
            if kind == "F":
                gaps.append(at[r + 1][("F", mb)][0] - at[r][("F", mb)][1])
            else:
                gaps.append(at[r][("B", mb)][0] - at[r + 1][("B", mb)][1])
    return sorted(gaps)


def draw(panels, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    x_max = max(e for stages, _ in panels.values() for stage in stages for *_, e in stage)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.5 * len(panels) + 1.4), sharex=True,
                             layout="constrained")
    bubble = (STAGES - 1) / (MICRO + STAGES - 1)
    for ax, (name, (stages, metrics)) in zip(axes, panels.items()):
        for r, stage in enumerate(stages):
            y = STAGES - 1 - r
            for kind, mb, b, e in stage:
                ax.broken_barh([(b, e - b)], (y - 0.35, 0.7), color=COLOURS[kind], edgecolor="white", lw=0.6)
                ax.text((b + e) / 2, y, f"{kind}{mb}", ha="center", va="center", fontsize=8)
        kept = metrics["saved_peak_bytes"]
        ax.set_yticks(range(STAGES))
        ax.set_yticklabels([f"stage {STAGES - 1 - y}\nkeeps {kept[STAGES - 1 - y] / 2**20:.1f} MiB"
                            for y in range(STAGES)], fontsize=8)
        ax.set_ylim(-0.6, STAGES - 0.4)
        span = max(e for stage in stages for *_, e in stage)
        shares = ", ".join(f"{s:.0%}" for s in idle(stages))
        ax.set_title(PANELS[name], fontsize=9, loc="left")
        ax.set_title(f"step {span:.1f} ms; idle {shares} (the bubble alone: {bubble:.0%})", fontsize=9,
                     loc="right")
        ax.grid(True, axis="x", color="#eee", lw=0.6)
        ax.set_axisbelow(True)
    axes[-1].set_xlim(0, x_max * 1.01)
    axes[-1].set_xlabel("ms from the step's first forward")
    fig.legend(handles=[Patch(color=COLOURS["F"], label="forward of micro-batch i (Fi)"),
                        Patch(color=COLOURS["B"], label="backward of micro-batch i (Bi)")],
               loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"One step of lesson 11's MLP (width {WIDTH}) on {STAGES} pipeline stages, {MICRO} "
                 f"micro-batches of {BATCH // MICRO}, Gloo on CPU\n({cpu_name()}, {cores()} cores, "
                 f"{date.today():%Y-%m}; the fastest of {STEPS - 1} steps; keeps: the activations "
                 f"autograd holds at the stage's peak)", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "pipeline_schedules.png")
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    args = parser.parse_args()
    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", args.data_dir, verbose=False)
    panels = {}
    for name in PANELS:
        metrics = run(name, ["--dataset", dataset, "--data-dir", args.data_dir])
        step, stages = fastest_step(metrics["timeline"])
        panels[name] = stages, metrics
        slot = metrics["slot_seconds"] * 1e3
        print(f"{name:<13} step {step}: {max(e for s in stages for *_, e in s):.1f} ms, idle "
              f"{', '.join(f'{s:.0%}' for s in idle(stages))}; the slowest stage's forward + backward "
              f"{slot:.2f} ms, {MICRO + STAGES - 1} such slots {(MICRO + STAGES - 1) * slot:.1f} ms; "
              f"hand-overs {handovers(stages)[0]:.2f} to {handovers(stages)[-1]:.2f} ms")
    draw(panels, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
