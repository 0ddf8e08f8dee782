"""Lesson 9 across the network lab (root only): the ring all-reduce by hand against Gloo's, and what
made the ring take twice Gloo's time across a capped link: the order in which each step posts its
receive and its send.

Two lab hosts (tools/lab/netlab.py), one rank and one torch thread each, Gloo, at each rate of the link
(uncapped, 1 Gbit/s, 100 Mbit/s by default), in --rounds interleaved rounds of --repeats timed runs
(after one warm-up), each run as long as its slower rank took:
  gloo             dist.all_reduce of --mib MiB of float32
  ring             ddp_scripts/allreduce_by_hand.py's ring_all_reduce (each step: receive, then send)
  ring, send first the same function with the two posts of each step swapped (send, then receive)
  step, ...        one step alone: half the tensor each way at once, in either order
  one way          half the tensor in one direction only (what the link's rate allows)
Writes build/bench/ring_order.json and prints the medians. tools/figures/draw_inside_results.py --collect
copies the medians into lesson 9's figure data.

    sudo .venv/bin/python tools/bench/bench_ring_order.py [--rates none,10gbit,1gbit,100mbit] [--mib 16]

Needs root (network namespaces, tc); without it, one line saying so and exit code 77.
"""
import argparse
import inspect
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "lab"))
import bench_netlab  # noqa: E402  (both_hosts, python, machine)
import netlab  # noqa: E402
from bench import positive  # noqa: E402

PREFIX = "ringorder"
CASES = ["gloo", "ring", "ring, send first", "step, receive first", "step, send first", "one way"]
# A step of ring_all_reduce posts these two, in this order:
RECEIVE = """        if receive_into.numel():
            works.append(dist.irecv(receive_into, group=group, group_src=left))
"""
SEND = """        if send.numel():
            works.append(dist.isend(send, group=group, group_dst=right))
            sent += send.numel() * send.element_size()
"""


def send_first_ring(by_hand):
    """allreduce_by_hand's ring_all_reduce with each step's two posts swapped: the send, then the
    receive. Nothing else changes (the function is rebuilt from its own source)."""
    source = inspect.getsource(by_hand.ring_all_reduce)
    if RECEIVE + SEND not in source:
        raise ValueError("ring_all_reduce's step no longer posts its receive, then its send (RECEIVE, SEND)")
    namespace = dict(vars(by_hand))
    exec(source.replace(RECEIVE + SEND, SEND + RECEIVE), namespace)
    return namespace["ring_all_reduce"]


# One rank per host; rank 0 prints {case: [seconds, ...]} as JSON.
RANK = r'''
import importlib.util, json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, master, port, mib, repeats, rounds, script, cases, tools = sys.argv[1:]
rank, repeats, rounds = int(rank), int(repeats), int(rounds)
spec = importlib.util.spec_from_file_location("allreduce_by_hand", script)
by_hand = importlib.util.module_from_spec(spec)
spec.loader.exec_module(by_hand)
sys.path.insert(0, tools)
from bench_ring_order import send_first_ring
ring_send_first = send_first_ring(by_hand)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=600))
other = 1 - rank
x = torch.randn(int(float(mib) * 2**20) // 4)
half, into = x[: x.numel() // 2], torch.empty(x.numel() // 2)


def step(receive_first):
    if receive_first:
        works = [dist.irecv(into, src=other), dist.isend(half, dst=other)]
    else:
        works = [dist.isend(half, dst=other), dist.irecv(into, src=other)]
    for work in works:
        work.wait()


def one_way():
    if rank == 0:
        dist.send(half, dst=1)
    else:
        dist.recv(into, src=0)


run = {"gloo": lambda: dist.all_reduce(x), "ring": lambda: by_hand.ring_all_reduce(x),
       "ring, send first": lambda: ring_send_first(x),
       "step, receive first": lambda: step(True), "step, send first": lambda: step(False), "one way": one_way}
times = {case: [] for case in cases.split("|")}
for _ in range(rounds):
    for case in times:
        for k in range(repeats + 1):  # k = 0: a warm-up, not kept
            dist.barrier()
            start = time.perf_counter()
            run[case]()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            x.div_(2)  # keep the values from growing
            if k:
                times[case].append(took.item())
if rank == 0:
    print(json.dumps(times), flush=True)
dist.destroy_process_group()
'''


def measure(lab, mib, repeats, rounds):
    master, port = lab.address(lab.hosts[0]), lab.port()
    script = REPO / "ddp_scripts" / "allreduce_by_hand.py"
    results = bench_netlab.both_hosts(
        lab, [[bench_netlab.python(), "-c", RANK, rank, master, port, mib, repeats, rounds, script,
               "|".join(CASES), REPO / "tools" / "bench"] for rank in (0, 1)], timeout=1800)
    for code, out in results:
        if code != 0:
            raise RuntimeError(f"the all-reduce across the lab failed:\n{out}")
    return json.loads(results[0][1].strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rates", default="none,10gbit,1gbit,100mbit",
                   help="the link's bandwidths (none: uncapped)")
    p.add_argument("--mib", type=positive(float), default=16, help="the tensor all-reduced, MiB")
    p.add_argument("--repeats", type=positive(int), default=4, help="timed runs of each case per round")
    p.add_argument("--rounds", type=positive(int), default=2)
    p.add_argument("--json", default=str(REPO / "build" / "bench" / "ring_order.json"))
    args = p.parse_args()
    reason = netlab.missing_requirements()
    if reason:
        print(f"bench_ring_order: skipped: {reason} (run it as root)", file=sys.stderr)
        sys.exit(77)
    data = {"date": datetime.now().isoformat(timespec="seconds"), "machine": bench_netlab.machine(),
            "mib": args.mib, "statistic": f"median of {args.rounds} x {args.repeats} runs, the slower rank's",
            "rates": []}
    with netlab.Lab(prefix=PREFIX) as lab:
        for rate in args.rates.split(","):
            lab.set_rate(rate)
            bits = netlab.parse_rate(rate)
            times = measure(lab, args.mib, args.repeats, args.rounds)
            entry = {"rate": rate, "wire_s": None if bits is None else args.mib * 2**20 * 8 / bits,
                     "median_s": {case: statistics.median(t) for case, t in times.items()}, "runs_s": times}
            data["rates"].append(entry)
            medians = ", ".join(f"{case} {1e3 * s:.1f} ms" for case, s in entry["median_s"].items())
            print(f"{rate:>8}: {medians}" + ("" if bits is None else  # N = 2: each rank sends the tensor
                  f"; the least the wire allows the all-reduce: {1e3 * entry['wire_s']:.1f} ms"), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
