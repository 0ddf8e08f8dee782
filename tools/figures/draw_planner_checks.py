"""Draw figures/planner_checks.png: lesson 13's planner (ddp_scripts/plan_parallelism.py) against the
ZeRO paper and against the course's own measurements, as tests/unit/test_plan_parallelism.py checks it.

    (a) the ZeRO paper's Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam, per stage
    (b) the state one rank holds, predicted against counted: mnist_fsdp.py (ddp, zero, fsdp on 1-3
        ranks) and sharding_by_hand.py (zero1, zero2, zero3 on 2 and 3), docs/measured/fsdp.json
    (c) an all-reduce's time across the network lab's capped links, back to back, measured (points:
        the median round; bars: the fastest and slowest rounds) and predicted (lines; alpha and the
        hosts' bandwidth fitted on the uncapped link; filled points are those the test checks),
        docs/measured/netlab_allreduce.json
    (d) lesson 11's pipeline step against its micro-batches, measured (3 runs each) and the planner's
        m + p - 1 slots fitted on M = 1 and 16, docs/measured/pipeline.json

Reads only the committed measurement files (make bench writes them); runs nothing.

    python tools/figures/draw_planner_checks.py [--out figures/planner_checks.png]
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "docs" / "measured"
sys.path.insert(0, str(REPO / "ddp_scripts"))
import plan_parallelism as planner  # noqa: E402

PAPER = [120.0, 31.4, 16.6, 1.9]  # GB per device, ZeRO's Figure 1
LINK_LABELS = {"10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}


def short(machine):
    """"Intel(R) Xeon(R) Processor, 2 cores, ..." -> "Intel Xeon"."""
    return machine.replace("(R)", "").split(",")[0].replace(" Processor", "")


def draw(out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), layout="constrained")
    (a, b), (c, d) = axes

    model, training = planner.Model([("all", 7_500_000_000)]), planner.Training("adam", "bf16-mixed")
    ours = [sum(planner.state_bytes(model, training, stage, 64).values()) / 1e9 for stage in range(4)]
    xs = range(4)
    a.bar([x - 0.2 for x in xs], PAPER, 0.4, label="the paper", color="#bbbbbb")
    a.bar([x + 0.2 for x in xs], ours, 0.4, label="the planner", color="#4f81bd")
    for x, value in zip(xs, ours):
        a.text(x + 0.2, value, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(xs), ["DDP", "ZeRO-1\n(P_os)", "ZeRO-2\n(P_os+g)", "ZeRO-3\n(P_os+g+p)"])
    a.set_ylabel("GB per GPU")
    a.set_title("(a) ZeRO's Figure 1: 7.5B parameters, 64 GPUs, Adam, K = 12", fontsize=9, loc="left")
    a.legend(fontsize=8)

    fsdp = json.loads((MEASURED / "fsdp.json").read_text())
    points = [(script, counted, predicted) for script, _, _, counted, predicted in planner.state_checks(fsdp)]
    top = 1.1 * max(max(m, p) for _, m, p in points) / 2**20
    b.fill_between([0, top], [0, 0.95 * top], [0, 1.05 * top], color="#eeeeee", label="within 5%")
    b.plot([0, top], [0, top], color="#888888", lw=0.8)
    for name, counted, predicted in points:
        b.scatter(counted / 2**20, predicted / 2**20, s=18,
                  color="#c0504d" if name == "sharding_by_hand.py" else "#4f81bd")
    b.set_xlabel("counted from the ranks' tensors (MiB)")
    b.set_ylabel("predicted (MiB)")
    b.set_title(f"(b) lesson 10's MLP, AdamW: the fullest rank's state, {len(points)} runs\n"
                f"(blue mnist_fsdp.py, red sharding_by_hand.py; {short(fsdp['machine'])}, {fsdp['date']})",
                fontsize=9, loc="left")
    b.legend(fontsize=8, loc="upper left")

    lab = json.loads((MEASURED / "netlab_allreduce.json").read_text())
    checks = planner.lab_all_reduce_checks(lab)
    for (rate, label), colour in zip(LINK_LABELS.items(), ["#4f81bd", "#9bbb59", "#c0504d"]):
        rows = [row for row in checks if row[0] == rate]
        sizes = [size for _, size, *_ in rows]
        rounds = [row["torch_rounds_s"] for entry in lab["rates"] if entry["rate"] == rate
                  for row in entry["all_reduce"]["rows"]]
        c.vlines(sizes, [1e3 * min(r) for r in rounds], [1e3 * max(r) for r in rounds], color=colour, lw=0.8)
        c.scatter(sizes, [1e3 * measured for _, _, measured, *_ in rows], s=16, color=colour,
                  facecolors=[colour if checked else "white" for *_, checked in rows],
                  label=f"{label}, measured")
        c.plot(sizes, [1e3 * predicted for *_, predicted, _ in rows], color=colour, lw=1,
               label=f"{label}, predicted")
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("bytes all-reduced (2 ranks, one per lab host, Gloo)")
    c.set_ylabel("ms")
    c.set_title(f"(c) all-reduce across the lab's capped links, back to back\n({short(lab['machine'])}, "
                f"{lab['date'][:10]}; fitted on the uncapped link; filled: checked)",
                fontsize=9, loc="left")
    c.legend(fontsize=7, ncol=2)

    pipe = json.loads((MEASURED / "pipeline.json").read_text())
    steps = {r["microbatches"]: r["step_s"] for r in pipe["rows"]}
    whole, each = planner.fit_pipeline(steps, 2, fit_on=(1, 16))
    ms = sorted(steps)
    for r in pipe["rows"]:
        d.scatter([r["microbatches"]] * len(r["runs"]), [1e3 * run["step_s"] for run in r["runs"]], s=14,
                  color="#4f81bd")
    d.plot(ms, [1e3 * planner.pipeline_step_s(m, 2, whole, each) for m in ms], color="#c0504d", lw=1,
           label=f"(m + 1) (w / m + c): w {whole * 1e3:.2f} ms, c {each * 1e3:.2f} ms (fitted on M = 1, 16)")
    d.plot(ms, [1e3 * planner.pipeline_step_s(m, 2, steps[1] / 2, 0) for m in ms], color="#888888", lw=1,
           ls="--", label="the bubble alone: no cost per micro-batch")
    d.set_xscale("log", base=2)
    d.set_xticks(ms, [str(m) for m in ms])
    d.set_xlabel("micro-batches M (a global batch of 64)")
    d.set_ylabel("ms a step")
    d.set_title(f"(d) lesson 11's pipeline on 2 stages, GPipe\n(points: runs; {short(pipe['machine'])}, "
                f"{pipe['date']})", fontsize=9, loc="left")
    d.legend(fontsize=7)
    fig.suptitle("Lesson 13's planner against the ZeRO paper and the course's measurements "
                 "(tests/unit/test_plan_parallelism.py checks each)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "planner_checks.png")
    args = parser.parse_args()
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
