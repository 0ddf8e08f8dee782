"""Benchmark for DDP by hand: the time of one training step in each of mnist_by_hand.py's ways of
averaging the gradients, against DDP's, at 2 ranks on THIS machine (Gloo, one thread per rank).

Rows: lesson 6's MLP (23 MB of gradients) and the ConvNet (1.2 MB), each with DDP (its default
buckets) and the by-hand modes per-tensor, flat, overlap and bucketed (with DDP's default sizes, so
the same buckets as DDP's); then, on the MLP, the bucketed mode and DDP's --bucket-cap-mb at several
bucket sizes; and a variant defined here, bucketed with a new buffer from torch.cat each step instead
of the one the script keeps from step to step (as DDP keeps its buckets), with the page faults per
step of each row: what tells the two apart. Ratios are to DDP with its default buckets, on the same model.

All the rows are timed by one harness, in the same loop: the same model from the same seed, the
same batches of 64 per rank, a step timed from zero_grad to the end of optimizer.step(). The by-hand
modes are mnist_by_hand.py's own classes; DDP is wrapped as mnist_ddp_comm.py wraps it
(DDP(model, bucket_cap_mb=...)). The scripts' printed numbers are not comparable with each other:
mnist_by_hand.py reports a median step, mnist_ddp_comm.py images/s over the epoch, its first steps
included. Each launch (--repeats) builds every configuration, then trains them in --rounds rounds:
in each round every configuration takes a block of --block steps in turn (the first, just after the
switch, not kept), in an order rotated from round to round, so that what else the machine runs
falls on all of them alike. ms per step: the median over the launches of each launch's median.
Ratio to DDP: the median over every round of the ratio to DDP's time in the same round (paired,
which cancels most of a shared machine's drift).

Then one launch more profiles 3 steps of the MLP's rows (torch.profiler, the traces under
build/bench/by_hand_traces/) and says where the time goes: forward, backward (its first to its
last gradient operator), after backward until the optimizer (waiting for the all-reduces,
averaging, copying back), the copies into and out of flat buffers, and how much of the all-reduces
ran during backward.

Writes build/bench/by_hand.json and figures/by_hand_step_time.png.

    python tools/bench/bench_by_hand.py [--repeats 3] [--rounds 8] [--block 5] [--plot-only]
"""
import argparse
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "ddp_scripts"
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "figures"), str(SCRIPTS)]
import ddp_hardening as hardening  # noqa: E402  (free_port)
import draw_overlap_trace  # noqa: E402  (the trace parsing)

MODES = ["per-tensor", "flat", "overlap", "bucketed"]
# The MLP's gradients, in backward's order: 0.08 MiB (layer 3), 16 MiB (layer 2), 6.1 MiB (layer 1),
# and their biases. A bucket closes once it holds its size: 0.05 MiB makes 3 buckets; 4 MiB makes 2
# (16.09 + 6.13 MiB, the same two as DDP's defaults); 25 MiB makes 1.
SWEEP_MB = [0.05, 4, 25]
WORLD, BATCH = 2, 64


def configurations():
    """(model, mode, bucket MiB or None for DDP's default); the first of each model is its reference."""
    rows = []
    for model in ("mlp", "convnet"):
        rows += [(model, "ddp", None)]
        rows += [(model, mode, None) for mode in MODES]  # bucketed: DDP's default sizes
    for mb in SWEEP_MB:
        rows += [("mlp", "bucketed", float(mb)), ("mlp", "ddp", float(mb))]
    return rows + [("mlp", "bucketed-new", None)]  # a variant: what a new buffer each step costs


def key(config):
    model, mode, mb = config
    return f"{model} {mode}" + (f" {mb:g} MiB" if mb else "")


def label(config):
    model, mode, mb = config
    if mode == "ddp":
        return "DDP, default buckets" if mb is None else f"DDP, --bucket-cap-mb {mb:g}"
    if mode == "bucketed-new":
        return "variant: bucketed, a new buffer each step"
    if mode == "bucketed":
        return f"by hand, bucketed {mb:g} MiB" if mb else "by hand, bucketed (DDP's sizes)"
    return f"by hand, {mode}"


# --------------------------------------------------------------------------- the harness (each rank)
def load_by_hand():
    spec = importlib.util.spec_from_file_location("mnist_by_hand", SCRIPTS / "mnist_by_hand.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wrap(by_hand, config):
    """The model of `config` (seed 0), what forward runs, and what to call after backward."""
    model_name, mode, mb = config
    torch.manual_seed(0)
    model = by_hand.build_model(model_name)
    if mode == "ddp":
        return model, DDP(model, bucket_cap_mb=mb), None  # as mnist_ddp_comm.py wraps it
    if mode == "bucketed-new":
        return model, model, new_buffers(by_hand)(model, mb)
    sync = by_hand.Bucketed(model, mb) if mode == "bucketed" else by_hand.SYNC[mode](model)
    return model, model, sync


def new_buffers(by_hand):
    """mnist_by_hand.py's Bucketed, but each bucket gathered into a new buffer each step (torch.cat
    without out=) instead of the one it keeps from step to step: the one difference."""

    class NewBuffers(by_hand.Bucketed):
        def start(self, i):
            flat = torch.cat([by_hand.gradient(p).reshape(-1) for p in self.buckets[i]])
            self.pending[i] = (flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))

    return NewBuffers


class Trainer:
    """One configuration's model, wrapped, with its optimizer: train(n) takes n more steps."""

    def __init__(self, by_hand, config, images, labels, rank):
        self.config, self.images, self.labels, self.rank, self.done = config, images, labels, rank, 0
        self.model, self.step_model, self.sync = wrap(by_hand, config)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def train(self, steps, profiler=None):
        """The seconds of each step, from zero_grad to the end of the optimizer's step."""
        seconds = []
        for _ in range(steps):
            first = ((self.done * WORLD + self.rank) * BATCH) % (len(self.images) - BATCH)  # this rank's
            x, y = self.images[first:first + BATCH], self.labels[first:first + BATCH]
            start = time.perf_counter()
            self.optimizer.zero_grad()
            F.cross_entropy(self.step_model(x), y).backward()
            if self.sync:
                self.sync.finish_gradient_synchronization()
            self.optimizer.step()
            seconds.append(time.perf_counter() - start)
            self.done += 1
            if profiler:
                profiler.step()
        return seconds

    def bucket_bytes(self):
        if self.config[1] == "ddp":  # the buckets DDP uses after its first step (rebuilt in gradient order)
            logged = self.step_model._get_ddp_logging_data()
            return [int(b) for b in re.findall(r"\d+", logged.get("rebuilt_bucket_sizes")
                                                or logged.get("bucket_sizes", ""))]
        by_hand = getattr(self.sync, "buckets", [])
        return [sum(p.numel() * p.element_size() for p in bucket) for bucket in by_hand] or None


def profile_steps(trainer, folder):
    """Steps 3 to 5 of 6 under torch.profiler, as the scripts' --profile; the trace's path."""
    from torch.profiler import ProfilerActivity, profile, schedule

    path = Path(folder) / key(trainer.config).replace(" ", "_") / f"rank{trainer.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as p:
        trainer.train(6, p)
    return str(path)


def worker(rank, port, task, out):
    """Every configuration built at once, then trained in rounds: each round gives each
    configuration a block of --block steps in turn (its first step, after the switch, is not kept),
    so that whatever else the machine runs meanwhile falls on all of them alike."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    by_hand = load_by_hand()
    images, labels = by_hand.load_split(task["dataset"], task["data_dir"], train=True)
    if task["profile"]:
        results = {}
        for config in map(tuple, task["configs"]):
            trainer = Trainer(by_hand, config, images, labels, rank)
            results[key(config)] = profile_steps(trainer, task["profile"])
    else:
        trainers = [Trainer(by_hand, tuple(c), images, labels, rank) for c in task["configs"]]
        for trainer in trainers:
            trainer.train(task["warmup"])
        rounds = {key(t.config): [] for t in trainers}  # per round: the median of the block's steps
        faults = {key(t.config): 0 for t in trainers}  # page faults of this process (minor ones)
        for round_ in range(task["rounds"]):
            shift = round_ * len(trainers) // task["rounds"]
            for trainer in trainers[shift:] + trainers[:shift]:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                kept = trainer.train(task["block"])[1:]
                faults[key(trainer.config)] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
                rounds[key(trainer.config)].append(statistics.median(kept) * 1e3)
        steps = task["rounds"] * task["block"]
        results = {key(t.config): {"rounds_ms": rounds[key(t.config)], "bucket_bytes": t.bucket_bytes(),
                                   "page_faults_per_step": faults[key(t.config)] / steps} for t in trainers}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(task, out):
    port = hardening.free_port()
    mp.start_processes(worker, args=(port, task, str(out)), nprocs=WORLD, start_method="spawn")
    return json.loads(Path(out).read_text())


# --------------------------------------------------------------------------- machine, figure
def machine():
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                   if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        from bench import cpu_name

        cpu = cpu_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "torch": torch.__version__,
            "date": datetime.now().astimezone().isoformat(timespec="minutes"),
            "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def ratios(ours, theirs):
    """One configuration's step time over another's, in each round of each launch (the two given as
    [launch][round] medians)."""
    return [a / b for our, their in zip(ours, theirs) for a, b in zip(our, their)]


def quartiles(values):
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


def plot(data, out):
    """Left: each way's step time over DDP's, per model; right: the MLP's bucket sizes. Ratios paired
    by round (what a shared machine's drift leaves least disturbed), with their quartiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["key"]: r for r in data["rows"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 5.2), gridspec_kw={"width_ratios": [1.1, 1]},
                                      layout="constrained")
    names = ["ddp"] + MODES
    colours = {"ddp": "#4f81bd", "per-tensor": "#c0504d", "flat": "#f79646", "overlap": "#9bbb59",
               "bucketed": "#8064a2"}

    def spread(r):
        return [[r["vs_ddp"] - r["vs_ddp_quartiles"][0]], [r["vs_ddp_quartiles"][1] - r["vs_ddp"]]]

    ticks, tick_labels = [], []
    for m, model in enumerate(("mlp", "convnet")):
        for i, mode in enumerate(names):
            r = rows[key((model, mode, None))]
            y = m * (len(names) + 1.2) + i
            left.barh(y, r["vs_ddp"], color=colours[mode], height=0.8)
            if mode != "ddp":
                left.errorbar(r["vs_ddp"], y, xerr=spread(r), color="black", lw=0.8, capsize=2)
            left.text(max(r["vs_ddp_quartiles"][1], r["vs_ddp"]) + 0.02, y,
                      f"{r['vs_ddp']:.2f}x  ({r['ms']:.0f} ms)", va="center", fontsize=8)
            ticks.append(y)
            name = "DDP" if mode == "ddp" else mode + " (DDP's sizes)" * (mode == "bucketed")
            tick_labels.append(f"{model}: {name}")
    left.axvline(1, color="#555", lw=0.8, ls="--")
    left.set_yticks(ticks, tick_labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlim(0, max(r["vs_ddp_quartiles"][1] for r in rows.values()) + 0.45)
    left.set_xlabel("step time over DDP's in the same round (median; line: quartiles)\n"
                    "in brackets: ms per step, median of the launches")
    left.set_title("each way of averaging the gradients, against DDP on the same model", fontsize=9)

    for mode, marker in (("bucketed", "s"), ("ddp", "o")):
        sweep = [rows[key(("mlp", mode, float(mb)))] for mb in SWEEP_MB]
        right.errorbar(SWEEP_MB, [r["vs_ddp"] for r in sweep], fmt=f"{marker}-", color=colours[mode],
                       capsize=3, yerr=[[spread(r)[0][0] for r in sweep], [spread(r)[1][0] for r in sweep]],
                       label="by hand, bucketed" if mode == "bucketed" else "DDP, --bucket-cap-mb")
        for mb, r in zip(SWEEP_MB, sweep):  # how many buckets that size makes
            right.annotate(f"{len(r['buckets_mib'])}", (mb, r["vs_ddp"]), textcoords="offset points",
                           fontsize=8, xytext=(6, 4 if mode == "bucketed" else -10), color=colours[mode])
    variant = rows.get(key(("mlp", "bucketed-new", None)))
    if variant:  # DDP's default sizes make the MLP's buckets that 4 MiB makes
        right.plot([4], [variant["vs_ddp"]], "x", color="black", ms=8, mew=1.5,
                   label="variant: bucketed, DDP's sizes, a new buffer each step")
    for mode, style in (("overlap", ":"), ("per-tensor", "-.")):
        right.axhline(rows[key(("mlp", mode, None))]["vs_ddp"], color=colours[mode], ls=style, lw=1,
                      label=f"by hand, {mode}")
    right.axhline(1, color="#555", lw=0.8, ls="--", label="DDP, default buckets")
    right.set_xscale("log")
    right.set_xticks(SWEEP_MB, [f"{mb:g}" for mb in SWEEP_MB])
    right.set_xlabel("bucket size (MiB)")
    right.set_ylabel("step time over DDP's (default buckets)")
    right.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    right.set_title("the MLP, by bucket size\n(beside each point: how many buckets)", fontsize=9)
    m = data["machine"]
    fig.suptitle(f"DDP by hand against DDP: one training step, 2 ranks x 1 thread, Gloo, batch 64 per rank; "
                 f"{data['repeats']} launches x {data['rounds']} rounds\n{m['cpu']}, {m['cores']} cores, "
                 f"torch {m['torch']}, {m['date'][:10]}", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=hardening.positive(int), default=3,
                        help="launches, each with --rounds rounds")
    parser.add_argument("--rounds", type=hardening.positive(int), default=8, help="rounds per launch")
    parser.add_argument("--block", type=int, default=5, help="steps per configuration and round (1 + kept)")
    parser.add_argument("--warmup", type=int, default=3, help="steps of each configuration before the rounds")
    parser.add_argument("--data-dir", type=str, default=str(REPO / "data"))
    parser.add_argument("--figure", type=Path, default=REPO / "figures" / "by_hand_step_time.png")
    parser.add_argument("--json", type=Path, default=REPO / "build" / "bench" / "by_hand.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figure from --json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.json.read_text()), args.figure)
        return
    if args.block < 2:
        sys.exit("bench_by_hand: --block must be at least 2 (its first step is not kept)")
    if args.repeats * args.rounds < 2:
        sys.exit("bench_by_hand: the ratios' quartiles need two rounds or more "
                 "(--repeats x --rounds at least 2)")
    if args.warmup < 0:
        sys.exit("bench_by_hand: --warmup must be 0 or more")
    import mnist_parts

    dataset = mnist_parts.prepare_data("auto", args.data_dir, verbose=False)
    configs, about = configurations(), machine()
    print(f"machine: {about['cpu']}, {about['cores']} cores, torch {about['torch']}; {about['date']}; "
          f"load average {about['load_average_at_start']:.2f} at the start\n"
          f"dataset: {dataset}, {WORLD} ranks x 1 thread, Gloo, batch {BATCH} per rank; {args.repeats} "
          f"launches x {args.rounds} rounds x {args.block - 1} kept steps per configuration\n", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    task = {"dataset": dataset, "data_dir": args.data_dir, "warmup": args.warmup, "rounds": args.rounds,
            "block": args.block, "profile": None}
    rounds, buckets, faults = {key(c): [] for c in configs}, {}, {key(c): [] for c in configs}
    for repeat in range(args.repeats):
        shift = repeat * len(configs) // args.repeats
        got = launch({**task, "configs": configs[shift:] + configs[:shift]}, args.json.with_suffix(".part"))
        for k, r in got.items():
            rounds[k].append(r["rounds_ms"])  # per launch, the rounds' medians
            buckets[k] = r["bucket_bytes"]
            faults[k].append(r["page_faults_per_step"])
        said = ", ".join(f"{k} {statistics.median(r['rounds_ms']):.0f}" for k, r in got.items())
        print(f"  launch {repeat + 1}/{args.repeats} (median ms per step): {said}", flush=True)

    def paired(k, reference):
        return statistics.median(ratios(rounds[k], rounds[reference]))

    rows = []
    for c in configs:
        runs = [statistics.median(r) for r in rounds[key(c)]]
        rows.append({"key": key(c), "model": c[0], "mode": c[1], "bucket_mb": c[2], "label": label(c),
                     "ms": statistics.median(runs), "runs": runs, "rounds_ms": rounds[key(c)],
                     "vs_ddp": paired(key(c), key((c[0], "ddp", None))),
                     "vs_ddp_quartiles": quartiles(ratios(rounds[key(c)], rounds[key((c[0], "ddp", None))])),
                     "page_faults_per_step": statistics.median(faults[key(c)]),
                     "buckets_mib": [round(b / 2**20, 2) for b in buckets[key(c)] or []] or None})
    by_key = {r["key"]: r for r in rows}
    about["load_average_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"\nload average {about['load_average_at_end']:.2f} at the end\n"
          f"ms/step: median over the launches of each launch's median; vs DDP: the median over all "
          f"rounds of the ratio to DDP (default buckets, same model) in the same round\n"
          f"faults: the process's page faults per step (median over the launches)\n"
          f"\n{'model':<8} {'configuration':<38} {'ms/step':>8} {'vs DDP':>7}   {'launches':<16} "
          f"{'faults':>6}   buckets (MiB)")
    for r in rows:
        spread = f"{min(r['runs']):.1f} to {max(r['runs']):.1f}"
        print(f"{r['model']:<8} {r['label']:<38} {r['ms']:>8.1f} {r['vs_ddp']:>6.2f}x   {spread:<16} "
              f"{r['page_faults_per_step']:>6.0f}   "
              f"{' + '.join(f'{b:g}' for b in r['buckets_mib']) if r['buckets_mib'] else ''}")
    print("\nthe bucket sizes on the MLP, side by side (ratio: by hand to DDP at the same size, "
          "paired by round):")
    for mb in SWEEP_MB:
        hand, ddp = key(("mlp", "bucketed", float(mb))), key(("mlp", "ddp", float(mb)))
        print(f"  {mb:>3g} MiB   by hand {by_key[hand]['ms']:6.1f} ms   DDP {by_key[ddp]['ms']:6.1f} ms   "
              f"{paired(hand, ddp):.2f}x")

    # Where the time goes: a profile of 3 steps of each MLP row, rank 0.
    profiled = [c for c in configs if c[0] == "mlp" and c[2] is None]
    profiled += [("mlp", "bucketed", float(SWEEP_MB[0])), ("mlp", "bucketed", float(SWEEP_MB[-1]))]
    folder = args.json.parent / "by_hand_traces"
    traces = launch({**task, "configs": profiled, "profile": str(folder)}, args.json.with_suffix(".part"))
    args.json.with_suffix(".part").unlink()
    phases = {}
    print("\nwhere a step's time goes on the MLP (rank 0, torch.profiler, median of 3 steps, ms; "
          "the profiler slows each step):\n"
          f"{'configuration':<38} {'step':>6} {'forward':>8} {'backward':>9} {'after':>6} {'optim.':>7} "
          f"{'copies':>7} {'all-red.':>9} {'during bw':>10}")
    for c in profiled:
        steps = [draw_overlap_trace.phases(s) for s in draw_overlap_trace.read_steps(traces[key(c)])
                 if s.backward]
        phases[key(c)] = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
        p = phases[key(c)]
        print(f"{label(c):<38} {p['step']:>6.1f} {p['forward']:>8.1f} {p['backward']:>9.1f} "
              f"{p['after']:>6.1f} {p['optimizer']:>7.1f} {p['copies']:>7.1f} {p['allreduce']:>9.1f} "
              f"{p['overlap']:>10.1f}")
    print("  backward: its first to its last gradient operator; after: from there to optimizer.step() "
          "(waiting for the all-reduces, averaging, copying back); copies: into and out of flat buffers "
          "(cat, copy_, DDP's mul_out); all-red.: the all-reduces' summed time on Gloo's threads; "
          "during bw: how much of it ran during backward")

    data = {"machine": about, "dataset": dataset, "repeats": args.repeats, "rounds": args.rounds,
            "block": args.block, "warmup": args.warmup, "rows": rows, "profile_ms": phases}
    args.json.write_text(json.dumps(data, indent=2))
    plot(data, args.figure)
    print(f"\nwrote {args.json}, {args.figure} and the traces in {folder}")


if __name__ == "__main__":
    main()
