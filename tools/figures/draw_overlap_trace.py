"""Draw figures/ddp_overlap_trace.png: does the gradients' all-reduce overlap with backward?

One training step of rank 0 per panel, read from a torch.profiler trace (--profile DIR), for lesson
6's MLP (23 MB of gradients: the all-reduces are long enough to see) at 2 ranks on CPU with Gloo:

    ddp         mnist_ddp_comm.py (DDP, its default buckets)
    per-tensor  mnist_by_hand.py --sync per-tensor: one all-reduce per gradient, after backward
    overlap     mnist_by_hand.py --sync overlap: each gradient's all-reduce starts from a hook
    bucketed    mnist_by_hand.py --sync bucketed (its default: the buckets DDP makes, 16.09 + 6.13 MiB)

Upper row: the main thread, where backward's operators run (autograd's *Backward0 and
AccumulateGrad), with forward before them and the optimizer step after. Lower rows: the all-reduces
(gloo:all_reduce) on Gloo's own threads. An all-reduce that starts left of the dashed line (where
the last operator that computes a gradient ends) overlaps with backward. Of the 3 steps each trace
records, the fastest is drawn (the least disturbed by whatever else the machine runs); the time
axis is shared. Written for Gloo on CPU; NCCL's names are recognised but not tried on a GPU.

    python tools/figures/draw_overlap_trace.py [--out figures/ddp_overlap_trace.png] [--traces DIR]

--traces DIR: read DIR/<panel>/rank0.json where present, run (and keep there) the missing ones;
without it, every trace is made anew under build/traces/. read_steps() and overlapping() are the
parsing that tests/e2e/test_profile_trace.py checks.
"""
import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"
COMMON = ["--nprocs", "2", "--model", "mlp", "--max-steps", "6", "--threads-per-proc", "1"]
PANELS = {  # name: (script, flags, title)
    "ddp": ("mnist_ddp_comm.py", ["--backend", "gloo", "--device", "cpu", "--quiet"],
            "DDP (mnist_ddp_comm.py, its default buckets)"),
    "per-tensor": ("mnist_by_hand.py", ["--sync", "per-tensor"],
                   "by hand, --sync per-tensor (after backward)"),
    "overlap": ("mnist_by_hand.py", ["--sync", "overlap"],
                "by hand, --sync overlap (a hook per gradient)"),
    "bucketed": ("mnist_by_hand.py", ["--sync", "bucketed"],
                 "by hand, --sync bucketed (DDP's buckets: 16.09 + 6.13 MiB)"),
}
ACCUMULATE = "torch::autograd::AccumulateGrad"
# Gradients copied into or out of a flat buffer: the by-hand modes' torch.cat and copy_; DDP copies
# into its bucket while dividing by the world size (mul_out), and back with copy_.
COPIES = ("aten::cat", "aten::copy_", "torch::distributed::reducer::mul_out")
COLOURS = {"forward": "#d9d9d9", "backward": "#4f81bd", "copy": "#8064a2", "optimizer": "#7f7f7f",
           "allreduce": "#e07b39", "wait": "#fbe5d6"}


# --------------------------------------------------------------------------- reading a trace
def is_backward(name):
    """An operator that autograd's engine runs in backward: AddmmBackward0, AccumulateGrad, ...
    (not the engine's evaluate_function wrappers around them)."""
    return (name.endswith(("Backward0", "Backward1")) or name == ACCUMULATE) \
        and not name.startswith("autograd::")


def is_allreduce(name):
    """The all-reduce itself, where the backend runs it: gloo:all_reduce on Gloo's threads (NCCL:
    nccl:all_reduce, and its kernels on a GPU stream). c10d::allreduce_ on the main thread only
    hands it over."""
    return name in ("gloo:all_reduce", "nccl:all_reduce") or "AllReduce" in name


@dataclass
class Step:
    """One profiled step of one rank; times in ms from the step's start."""
    name: str
    duration: float
    backward: list = field(default_factory=list)   # (operator, start, end) on the main thread
    allreduce: list = field(default_factory=list)  # (lane, start, end); lane 0, 1, ...: a thread
    copies: list = field(default_factory=list)     # (operator, start, end): COPIES after backward began
    forward: tuple = None                          # (start, end): from zero_grad to backward
    optimizer: tuple = None                        # (start, end) of optimizer.step()

    @property
    def backward_end(self):
        """Where the last operator that computes a gradient ends (AccumulateGrad, which only adds
        it into .grad and runs the hooks that may start an all-reduce, does not count)."""
        return max(end for op, _, end in self.backward if op != ACCUMULATE)

    @property
    def backward_start(self):
        return min(start for _, start, _ in self.backward)


def read_steps(path):
    """Every ProfilerStep#N of the main thread in the chrome trace at `path`, as a Step."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"]
              if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not marks:
        raise ValueError(f"{path}: no ProfilerStep# events (was the profiler stepped?)")
    main = marks[0]["tid"]
    steps = []
    for mark in marks:
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]

        def span(e):
            return ((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)

        inside = [e for e in events if t0 <= e["ts"] < t1]
        on_main = [e for e in inside if e["tid"] == main]
        step = Step(mark["name"], mark["dur"] / 1e3)
        step.backward = [(e["name"], *span(e)) for e in on_main if is_backward(e["name"])]
        lanes = {}  # the threads (or streams) that run this step's all-reduces, in order of their first
        for e in sorted(inside, key=lambda e: e["ts"]):
            if is_allreduce(e["name"]) and e["tid"] != main:
                lanes.setdefault(e["tid"], len(lanes))
        step.allreduce = sorted((lanes[e["tid"]], *span(e)) for e in inside if e["tid"] in lanes
                                and is_allreduce(e["name"]))
        zeroed = [span(e)[1] for e in on_main if e["name"].startswith("Optimizer.zero_grad#")]
        stepped = [span(e) for e in on_main if e["name"].startswith("Optimizer.step#")]
        step.optimizer = stepped[0] if stepped else None
        if step.backward:
            step.forward = (zeroed[0] if zeroed else 0.0, step.backward_start)
            end = step.optimizer[0] if step.optimizer else step.duration
            step.copies = [(e["name"], *span(e)) for e in on_main if e["name"] in COPIES
                           and step.backward_start <= span(e)[0] < end]
        steps.append(step)
    return steps


def overlapping(step):
    """The all-reduces of `step` that start before backward's last operator ends."""
    return [a for a in step.allreduce if a[1] < step.backward_end]


def overlap_ms(step):
    """How long an all-reduce runs while backward is still under way (between its first and last
    operator), in ms: the union of the all-reduces' spans, cut to backward's."""
    lo, hi = step.backward_start, step.backward_end
    spans = sorted((max(s, lo), min(e, hi)) for _, s, e in step.allreduce if s < hi and e > lo)
    total, reach = 0.0, lo
    for s, e in spans:
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def phases(step):
    """Where the step's time goes, in ms: forward (from zero_grad's end to backward), backward
    (its first to its last gradient operator), after (from there to the optimizer: waiting for
    the all-reduces, averaging, copying back), optimizer; and across them: copies (COPIES),
    allreduce (the all-reduces' summed spans), overlap (overlap_ms)."""
    end = step.optimizer[0] if step.optimizer else step.duration
    return {"step": step.duration, "forward": step.forward[1] - step.forward[0],
            "backward": step.backward_end - step.backward_start, "after": end - step.backward_end,
            "optimizer": step.optimizer[1] - step.optimizer[0] if step.optimizer else 0.0,
            "copies": sum(b - a for _, a, b in step.copies),
            "allreduce": sum(b - a for _, a, b in step.allreduce), "overlap": overlap_ms(step)}


def fastest(steps):
    return min((s for s in steps if s.backward), key=lambda s: s.duration)


# --------------------------------------------------------------------------- making the traces
def make_trace(panel, folder, data_args):
    script, flags, _ = PANELS[panel]
    cmd = [sys.executable, str(SCRIPTS / script), *COMMON, *flags, *data_args, "--profile", str(folder)]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    print(f"tracing {panel}: {' '.join(cmd[1:])}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 or not (folder / "rank0.json").exists():
        sys.exit(f"draw_overlap_trace: {panel} failed:\n{r.stderr[-3000:]}")


# --------------------------------------------------------------------------- drawing
def draw(steps, out):
    """steps: {panel: Step}; one panel each, stacked, on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = {name: 1 + max((a[0] for a in s.allreduce), default=0) for name, s in steps.items()}
    heights = [1.1 + 0.4 * lanes[name] for name in steps]
    fig, axes = plt.subplots(len(steps), 1, figsize=(10, sum(heights) + 1.6), sharex=True,
                             layout="constrained", gridspec_kw={"height_ratios": heights})
    x_max = max(s.duration for s in steps.values())

    def bar(ax, y, start, end, colour, label=None, text_colour="black"):
        ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), color=colour, edgecolor="white", lw=0.4)
        if label and end - start > 0.012 * x_max * len(label):  # only where the words fit
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7.5, color=text_colour)

    for ax, (name, s) in zip(axes, steps.items()):
        main_y = lanes[name] + 0.2
        bar(ax, main_y, *s.forward, COLOURS["forward"], "forward + loss")
        end = s.optimizer[0] if s.optimizer else s.duration
        bar(ax, main_y, s.backward_end, end, COLOURS["wait"], "waiting for the all-reduces")
        for op, a, b in s.backward:
            bar(ax, main_y, a, b, COLOURS["backward"], None if op == ACCUMULATE else op, "white")
        for op, a, b in s.copies:
            bar(ax, main_y, a, b, COLOURS["copy"], op, "white")
        if s.optimizer:
            bar(ax, main_y, *s.optimizer, COLOURS["optimizer"], "optimizer", "white")
        for lane, a, b in s.allreduce:
            bar(ax, lanes[name] - 1 - lane, a, b, COLOURS["allreduce"])
        ax.axvline(s.backward_end, color="#333", ls="--", lw=0.9)
        ax.set_yticks([main_y] + [lanes[name] - 1 - lane for lane in range(lanes[name])])
        ax.set_yticklabels(["main thread"] + [f"Gloo thread {lane + 1}" for lane in range(lanes[name])],
                           fontsize=8)
        ax.set_ylim(-0.55, main_y + 0.5)
        early = overlapping(s)
        said = (f"{len(early)} of {len(s.allreduce)} all-reduces start during backward: "
                f"{overlap_ms(s):.1f} ms of overlap" if early
                else f"{len(s.allreduce)} all-reduce{'s' * (len(s.allreduce) != 1)}, none during backward")
        ax.set_title(PANELS[name][2] if name in PANELS else name, fontsize=9, loc="left")
        ax.set_title(f"{said}; step {s.duration:.0f} ms", fontsize=9, loc="right")
        ax.grid(True, axis="x", color="#eee", lw=0.6)
        ax.set_axisbelow(True)
    axes[-1].set_xlim(0, x_max * 1.01)
    axes[-1].set_xlabel("ms from the start of the step (rank 0)")
    legend = [Patch(color=COLOURS["forward"], label="forward + loss"),
              Patch(color=COLOURS["backward"], label="backward operator (AddmmBackward0, ...)"),
              Patch(color=COLOURS["copy"], label="copy into or out of a flat buffer (cat, copy_, mul_out)"),
              Patch(color=COLOURS["wait"], label="after backward: waiting for the all-reduces, averaging"),
              Patch(color=COLOURS["optimizer"], label="optimizer step"),
              Patch(color=COLOURS["allreduce"], label="gloo:all_reduce (Gloo's threads)"),
              Line2D([], [], color="#333", ls="--", lw=0.9, label="the last gradient operator ends")]
    fig.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("One training step of rank 0: lesson 6's MLP, 2 ranks on CPU with Gloo, torch.profiler "
                 "(the fastest of the 3 steps each trace records)", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "ddp_overlap_trace.png")
    parser.add_argument("--traces", type=Path, default=None,
                        help="read the traces there (DIR/<panel>/rank0.json), run the missing ones into it")
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    args = parser.parse_args()
    folder = args.traces or REPO / "build" / "traces"
    missing = [p for p in PANELS if args.traces is None or not (folder / p / "rank0.json").exists()]
    if missing:
        sys.path.insert(0, str(SCRIPTS))
        import mnist_parts

        dataset = mnist_parts.prepare_data("auto", args.data_dir, verbose=False)
        for panel in missing:
            make_trace(panel, folder / panel, ["--dataset", dataset, "--data-dir", args.data_dir])
    steps = {panel: fastest(read_steps(folder / panel / "rank0.json")) for panel in PANELS}
    for panel, s in steps.items():
        print(f"{panel:<11} step {s.duration:6.1f} ms, backward ends at {s.backward_end:6.1f} ms, "
              f"{len(s.allreduce)} all-reduces, {len(overlapping(s))} start during backward, "
              f"{overlap_ms(s):5.1f} ms overlap")
    draw(steps, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
