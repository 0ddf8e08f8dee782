"""Lesson 9's measured results in one figure, figures/ddp_inside_results.png, from the committed data
figures/ddp_inside_results.json (each part with its machine, date and source; the details are in
docs/MEASURED.md):

  the all-reduce    one all-reduce of 16 MiB over 2 ranks: Gloo's, the ring by hand (receive posted
                    first, as ddp_scripts/allreduce_by_hand.py does), the ring with its send posted
                    first; on one machine and across the network lab at four link speeds
  its fixed cost    the all-reduce of the smallest messages against the number of ranks N, with
                    lesson 6's 2 (N - 1) alpha drawn from N = 2
  one step          each way of averaging the gradients by hand against DDP (mnist_by_hand.py --sync)
  across the lab    lesson 6's MLP trained across the lab: one bucket (no overlap) and 1 MiB buckets
                    against DDP's default buckets

    python tools/figures/draw_inside_results.py              # draw from the committed data
    python tools/figures/draw_inside_results.py --collect    # first take in what the benchmarks wrote

--collect replaces each part whose benchmark output is there: in build/bench/, allreduce.json and
latency_n2.json, latency_n3.json, latency_n4.json (`make bench BENCH=allreduce`), by_hand.json
(`make bench BENCH=by-hand`) and, as root, ring_order.json (tools/bench/bench_ring_order.py); and the
committed docs/measured/netlab.json (as root, `make bench BENCH=netlab`). The all-reduce's size
is ring_order.json's (--mib): the one-machine bar is allreduce.json's row of that size, and
--collect refuses to mix two sizes in panel (a).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "figures" / "ddp_inside_results.json"
FIGURE = REPO / "figures" / "ddp_inside_results.png"
BENCH = REPO / "build" / "bench"
NETLAB = REPO / "docs" / "measured" / "netlab.json"  # committed: tools/bench/bench_netlab.py writes it
SMALL = 4096  # bytes: the messages whose median time is the fixed cost
LINKS = {"none": "lab, uncapped", "10gbit": "lab, 10 Gbit/s", "1gbit": "lab, 1 Gbit/s",
         "100mbit": "lab, 100 Mbit/s"}
WAYS = ["per-tensor", "flat", "overlap", "bucketed"]
# bench_netlab.py's names of the configurations drawn against "DDP, default buckets", and their
# labels (--bucket-cap-mb counts MiB)
CONFIGS = ["one 100 MB bucket (no overlap)", "1 MB buckets"]
CONFIG_LABELS = {"one 100 MB bucket (no overlap)": "one bucket, cap 100 MiB (no overlap)",
                 "1 MB buckets": "1 MiB buckets (on this MLP, the default's two)"}


def where(machine, date):
    """'AMD EPYC, 2 cores, 2026-12-04' from a benchmark's machine (a dict, or already a string) and date."""
    if isinstance(machine, dict):
        machine = f"{machine['cpu']}, {machine['cores']} cores"
    return f"{machine}, {date[:10]}"


def ms(seconds):
    return round(1e3 * seconds, 2)


def collect(data, bench=BENCH, netlab=NETLAB):
    """Replace the parts of `data` whose benchmark output is in `bench` (and `netlab`, the lab
    benchmark's committed run); returns the names replaced. Raises ValueError, before changing
    anything, when panel (a) would mix two sizes of all-reduce."""
    replaced = []
    order = bench / "ring_order.json"
    order_run = json.loads(order.read_text()) if order.exists() else None
    mib = order_run["mib"] if order_run else data["all_reduce"]["mib"]  # the size of every bar of (a)
    allreduce = bench / "allreduce.json"
    one_machine = None
    if allreduce.exists():
        run = json.loads(allreduce.read_text())
        row = next((r for r in run["rows"] if r["bytes"] == mib * 2**20), None)
        if row is None:
            raise ValueError(f"{allreduce} has no all-reduce of {mib:g} MiB, ring_order.json's size: "
                             "rerun tools/bench/bench_ring_order.py with a size measured on one machine "
                             "(--mib 16)")
        m = run["machine"]
        one_machine = {"gloo_ms": ms(row["torch_s"]), "ring_ms": ms(row["ring_s"]),
                       "source": f"tools/figures/draw_allreduce_cost.py (make bench), "
                                 f"{where(m, run['date'])}"}
    elif mib != data["all_reduce"]["mib"]:
        raise ValueError(f"ring_order.json's all-reduce is {mib:g} MiB, the one-machine bar's "
                         f"{data['all_reduce']['mib']:g} MiB, and {allreduce} is missing: (a) would mix them")
    if one_machine:
        data["all_reduce"]["one_machine"] = one_machine
        replaced.append("all_reduce: one machine")
    latency = {n: bench / f"latency_n{n}.json" for n in (2, 3, 4)}
    if all(path.exists() for path in latency.values()):
        points = []
        for n, path in latency.items():
            run = json.loads(path.read_text())
            points.append({"nprocs": n, "ring_ms": ms(statistics.median(r["ring_s"] for r in run["rows"])),
                           "gloo_ms": ms(statistics.median(r["torch_s"] for r in run["rows"]))})
        m = run["machine"]
        data["fixed_cost"] = {
            "points": points, "source": f"allreduce_by_hand.py --mode measure --max-mb {SMALL / 2**20:g} "
            f"--repeats {run['repeats']}: the median over the sizes of each size's median, "
            f"{where(m, run['date'])}: N > {m['cores']} ranks share the cores"}
        replaced.append("fixed_cost")
    if order_run:
        run = order_run
        data["all_reduce"]["mib"] = run["mib"]
        data["all_reduce"]["lab"] = [
            {"link": LINKS.get(r["rate"], r["rate"]), "gloo_ms": ms(r["median_s"]["gloo"]),
             "ring_ms": ms(r["median_s"]["ring"]),
             "ring_send_first_ms": ms(r["median_s"]["ring, send first"]),
             "wire_ms": None if r["wire_s"] is None else ms(r["wire_s"])} for r in run["rates"]]
        data["all_reduce"]["lab_source"] = (f"tools/bench/bench_ring_order.py, {run['statistic']}, "
                                            f"{where(run['machine'], run['date'])}")
        replaced.append("all_reduce: lab")
    if (bench / "by_hand.json").exists():
        run = json.loads((bench / "by_hand.json").read_text())
        rows = {r["key"]: r for r in run["rows"]}
        m = run["machine"]
        way = {(model, name): rows[f"{model} {name}"] for model in ("mlp", "convnet") for name in WAYS}
        data["step"] = {"rows": [{"model": model, "way": name, "ratio": round(r["vs_ddp"], 4),
                                  "quartiles": [round(q, 4) for q in r["vs_ddp_quartiles"]]}
                                 for (model, name), r in way.items()],
                        "source": f"tools/bench/bench_by_hand.py (make bench), {run['repeats']} launches x "
                                  f"{run['rounds']} rounds, {where(m, m['date'])}"}
        replaced.append("step")
    if netlab.exists():
        run = json.loads(netlab.read_text())
        rows = []
        for rate in run["rates"]:
            training = rate["training"]
            base = training["DDP, default buckets"]["images_per_second"]
            for config in CONFIGS:
                values = [r["images_per_second"] / base for r in training[config]["runs"]]
                rows.append({"link": rate["label"], "config": config,
                             "ratio": round(training[config]["images_per_second"] / base, 3),
                             "low": round(min(values), 3), "high": round(max(values), 3)})
        data["lab_training"] = {"rows": rows, "source": f"tools/bench/bench_netlab.py (make bench, root; "
                                f"docs/measured/netlab.json), median of {run['runs']} runs, "
                                f"{where(run['machine'], run['date'])}"}
        replaced.append("lab_training")
    return replaced


def draw(data, out=FIGURE):
    """The four panels; returns out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import textwrap

    fig, axes = plt.subplots(2, 2, figsize=(12, 9.4), layout="constrained",
                             gridspec_kw={"width_ratios": [1.45, 1]})
    fig.get_layout_engine().set(rect=(0, 0.09, 1, 0.91))  # room for the sources below
    colours = {"gloo": "#4f81bd", "ring": "#c0504d", "ring_send_first": "#f2b5b4"}

    ax = axes[0][0]  # the all-reduce, one machine and the lab
    part = data["all_reduce"]
    links = [{"link": "one machine", **part["one_machine"]}] + part["lab"]
    labels = {"gloo": "Gloo's dist.all_reduce", "ring": "ring by hand (receive posted first)",
              "ring_send_first": "ring by hand, send posted first"}
    for j, name in enumerate(labels):
        xs = [i + (j - 1) * 0.27 for i, link in enumerate(links) if link.get(f"{name}_ms")]
        ys = [link[f"{name}_ms"] for link in links if link.get(f"{name}_ms")]
        ax.bar(xs, ys, 0.27, color=colours[name], label=labels[name])
        for x, y in zip(xs, ys):
            ax.text(x, y * 1.08, f"{y:,.0f}", ha="center", fontsize=7)
    for i, link in enumerate(links):
        if link.get("wire_ms"):
            ax.plot([i - 0.45, i + 0.45], [link["wire_ms"]] * 2, color="black", lw=1.2,
                    label=f"the least the link allows ({part['mib']:g} MiB each way)" if i == len(links) - 1
                    else None)
    ax.set_yscale("log")
    ax.set_ylim(top=max(link.get("ring_send_first_ms") or link["ring_ms"] for link in links) * 3)
    ax.set_xticks(range(len(links)), [link["link"].replace("lab, ", "lab,\n") for link in links], fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.set_title(f"(a) One all-reduce of {part['mib']:g} MiB, 2 ranks: on one machine and across the lab",
                 fontsize=9)
    sources = [f"(a) one machine: {part['one_machine']['source']}; lab: {part['lab_source']}"]

    ax = axes[0][1]  # the fixed cost against N
    part = data["fixed_cost"]
    ns = [p["nprocs"] for p in part["points"]]
    for name, label in (("gloo", "Gloo's"), ("ring", "ring by hand")):
        ys = [p[f"{name}_ms"] for p in part["points"]]
        ax.plot(ns, ys, "o-", color=colours[name], label=label)
        ax.plot(ns, [ys[0] * (n - 1) for n in ns], ":", color=colours[name], lw=1,
                label=f"{label}, 2 (N - 1) α from N = 2")
    ax.set_xticks(ns)
    ax.set_xlabel("ranks N (one machine)")
    ax.set_ylabel("ms (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5)
    ax.set_title(f"(b) The fixed cost: all-reduces of 4 B to {SMALL:,} B, by N", fontsize=9)
    sources.append(f"(b) {part['source']}")

    ax = axes[1][0]  # one training step against DDP
    part = data["step"]
    way_colours = {"per-tensor": "#c0504d", "flat": "#f79646", "overlap": "#9bbb59", "bucketed": "#8064a2"}
    ticks, names = [], []
    for i, row in enumerate(part["rows"]):
        y = i + (i >= len(WAYS)) * 0.8
        low, high = row["quartiles"]
        ax.barh(y, row["ratio"], color=way_colours[row["way"]], height=0.75)
        ax.errorbar(row["ratio"], y, xerr=[[row["ratio"] - low], [high - row["ratio"]]], color="black",
                    lw=0.8, capsize=2)
        ax.text(high + 0.02, y, f"{row['ratio']:.2f}x", va="center", fontsize=8)
        ticks.append(y)
        names.append(f"{row['model']}: {row['way']}")
    ax.axvline(1, color="#555", lw=0.8, ls="--")
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(row["quartiles"][1] for row in part["rows"]) + 0.3)
    ax.set_xlabel("step time over DDP's (median of the rounds; line: quartiles)")
    ax.set_title("(c) One training step against DDP's, 2 ranks x 1 thread, one machine", fontsize=9)
    sources.append(f"(c) {part['source']}")

    ax = axes[1][1]  # across the lab: buckets and overlap
    part = data["lab_training"]
    links = list(dict.fromkeys(row["link"] for row in part["rows"]))
    for j, config in enumerate(CONFIGS):
        rows = [next(r for r in part["rows"] if (r["link"], r["config"]) == (link, config)) for link in links]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(links))]
        ax.bar(xs, [r["ratio"] for r in rows], 0.38, color=["#8064a2", "#9bbb59"][j],
               label=CONFIG_LABELS[config],
               yerr=[[r["ratio"] - r["low"] for r in rows], [r["high"] - r["ratio"] for r in rows]],
               error_kw={"lw": 0.8, "capsize": 2})
    ax.axhline(1, color="#555", lw=0.8, ls="--", label="DDP, default buckets")
    ax.set_xticks(range(len(links)), links, fontsize=8)
    ax.set_ylim(0, max(1.5, max(row["high"] for row in part["rows"]) + 0.45))  # room for the legend
    ax.set_ylabel("images/s over DDP's (line: lowest to highest run)")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.set_title("(d) Lesson 6's MLP across the lab, one rank per host", fontsize=9)
    sources.append(f"(d) {part['source']}")

    fig.suptitle("Lesson 9, measured (details: docs/MEASURED.md)", fontsize=11)
    fig.text(0.01, 0.005, "\n".join(textwrap.fill(line, 190, subsequent_indent="     ") for line in sources),
             fontsize=7, color="0.3", va="bottom")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", action="store_true",
                        help="first take in build/bench/'s results and docs/measured/netlab.json")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    if args.collect:
        replaced = collect(data)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        print(f"took in: {', '.join(replaced) or 'nothing (no benchmark results found)'}; wrote {args.data}")
    print(f"wrote {draw(data, args.out)}")


if __name__ == "__main__":
    sys.exit(main())
