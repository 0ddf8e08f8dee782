"""DDP from the inside: the all-reduce built by hand, as a ring of point-to-point messages.

    python allreduce_by_hand.py --nprocs 3                            # check it against dist.all_reduce
    python allreduce_by_hand.py --mode measure --json allreduce.json  # time both, fit lesson 6's model

ring_all_reduce() sums a tensor over all ranks with nothing but dist.isend and dist.irecv, as a ring
(the algorithm of Gloo's all-reduce, which it runs in segments at every size, and one of NCCL's): a
reduce-scatter then an all-gather, each N - 1 steps around the ring, so that every rank sends
2 (N - 1) / N times the tensor's bytes, whatever N is.
--mode check compares it with dist.all_reduce on random tensors of awkward lengths (1, N - 1,
primes) and counts the bytes each rank sends. --mode measure times both on float32 tensors from
4 bytes to --max-mb MiB and fits lesson 6's cost model of a ring,
t = 2 (N - 1) alpha + 2 (N - 1) / N x n / B: alpha the latency of one step of the ring, B the
bandwidth of one rank's link, n the tensor's bytes. tools/figures/draw_allreduce_cost.py draws the
--json file.
A teaching script, with none of the hardening of mnist_ddp_cpu.py.
"""
import json
import os
import sys
import time
from datetime import datetime, timedelta

import torch
import torch.distributed as dist

try:  # the course's modules, written once: copy them beside this file
    from ddp_hardening import Parser, UsageError, positive, run_plainly
except ModuleNotFoundError as missing:  # copied alone: one line says what to copy
    sys.exit(f"{sys.argv[0]}: error: {missing.name}.py is missing: copy it from the course's ddp_scripts/")


# --------------------------------------------------------------------------- the ring
def ring_all_reduce(tensor, group=None):
    """Sum a contiguous `tensor` over the ranks of `group`, in place, with point-to-point messages
    only. Returns the number of bytes this rank sent."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:
        return 0  # one rank: the sum is the tensor itself
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)  # N views into the tensor; sizes differ by at most one
    incoming = torch.empty_like(chunks[0])  # room for the largest chunk (tensor_split puts it first)
    sent = 0

    def step(send, receive_into):
        """Send one chunk to the right neighbour while receiving one from the left. The receive is
        posted first, as in Gloo's own ring: with two ranks, where both neighbours are the same peer,
        a send posted first made many steps across a capped link up to twice as long (lesson 9,
        section 4; docs/MEASURED.md)."""
        nonlocal sent
        works = []  # every rank knows every chunk's size: an empty chunk is skipped on both sides
        if receive_into.numel():
            works.append(dist.irecv(receive_into, group=group, group_src=left))
        if send.numel():
            works.append(dist.isend(send, group=group, group_dst=right))
            sent += send.numel() * send.element_size()
        for work in works:  # async: both messages are under way; wait() blocks until each is done
            work.wait()

    # Reduce-scatter: at step s, send chunk (rank - s), the one we added to at step s - 1, and add the
    # left neighbour's chunk (rank - s - 1) to ours. Each chunk travels N - 1 hops to the right,
    # picking up one more rank's values per hop.
    for s in range(n - 1):
        mine = chunks[(rank - s - 1) % n]
        step(chunks[(rank - s) % n], incoming[:mine.numel()])
        mine += incoming[:mine.numel()]
    # Now rank r holds the whole sum of chunk (r + 1) % N, and partial sums of the others.

    # All-gather: at step s, pass on the whole chunk (rank + 1 - s) and receive the whole chunk
    # (rank - s) in its place, overwriting our partial sum.
    for s in range(n - 1):
        step(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    # Now every rank holds the whole sum of every chunk: the all-reduced tensor.
    return sent


# --------------------------------------------------------------------------- check mode
def check_lengths(n):
    """Awkward lengths too: 1, N - 1, N, primes, and a few divisible by N."""
    return sorted({1, max(1, n - 1), n, 7, 13, 97, 1009, 12 * n, 4099, 1024 * n})


def check(rank, n, quiet):
    """Ring versus dist.all_reduce on random tensors; returns the number of failures."""
    failures = 0
    for dtype in (torch.float32, torch.float64, torch.int64):
        for length in check_lengths(n):
            torch.manual_seed(1000 * rank + length)  # different values on every rank
            shape = (length // 4, 4) if length % 4 == 0 else (length,)  # some 2-D tensors
            if dtype.is_floating_point:
                x = torch.randn(shape, dtype=dtype)
            else:
                x = torch.randint(-1000, 1000, shape, dtype=dtype)
            ours, theirs, magnitude = x.clone(), x.clone(), x.abs()
            sent = ring_all_reduce(ours)
            dist.all_reduce(theirs)
            dist.all_reduce(magnitude)  # the sum of |x| over the ranks: what bounds the rounding
            if dtype.is_floating_point:  # the same N - 1 additions in another order: each result is
                # within (N - 1) eps / 2 x the sum of |x| of the exact sum; allowed: twice their gap
                bound = 2 * (n - 1) * torch.finfo(dtype).eps * magnitude
                equal = bool(((ours - theirs).abs() <= bound).all())
            else:
                equal = torch.equal(ours, theirs)  # integers: exactly
            # Every reduce-scatter and all-gather step moves the whole tensor once, over all ranks:
            # 2 (N - 1) x its bytes in all, 2 (N - 1) / N each when N divides the length.
            nbytes = x.numel() * x.element_size()
            total = torch.tensor([sent])
            dist.all_reduce(total)
            ok_bytes = total.item() == 2 * (n - 1) * nbytes
            if length % n == 0:
                ok_bytes = ok_bytes and sent * n == 2 * (n - 1) * nbytes
            failed = torch.tensor([int(not (equal and ok_bytes))])
            dist.all_reduce(failed)  # a failure on any rank counts
            failures += int(failed.item() > 0)
            if rank == 0 and (not quiet or failed.item()):
                diff = (ours - theirs).abs().max().item()
                print(f"{'MISMATCH' if failed.item() else 'ok':8} {str(dtype)[6:]:7} {str(shape):9} "
                      f"max |ring - all_reduce| {diff:.0e}, rank 0 sent {sent:5} bytes of {nbytes:5} "
                      f"(2(N-1)/N x {nbytes} = {2 * (n - 1) * nbytes / n:g})", flush=True)
    return failures


# --------------------------------------------------------------------------- measure mode
def message_sizes(max_mb):
    """Powers of 4 from 4 bytes (one float32) up to max_mb MiB."""
    sizes, size = [], 4
    while size <= max_mb * 2**20:
        sizes.append(size)
        size *= 4
    return sizes


def measure(rank, n, sizes, repeats, quiet):
    """Median seconds of one all-reduce per size, ring and Gloo's, interleaved; a run counts as long
    as the slowest rank took."""
    times = torch.zeros(len(sizes), 2, repeats, dtype=torch.float64)
    for i, size in enumerate(sizes):
        x = torch.randn(size // 4)
        for k in range(-1, repeats):  # k = -1: a warm-up, not counted
            for j, all_reduce in enumerate((ring_all_reduce, dist.all_reduce)):
                dist.barrier()  # everyone starts together
                start = time.perf_counter()
                all_reduce(x)
                if k >= 0:
                    times[i, j, k] = time.perf_counter() - start
                x.div_(n)  # keep the values from growing
        if rank == 0 and not quiet:
            print(f"measured {size:>11,} bytes", flush=True)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.quantile(0.5, dim=2)  # medians: sizes x (ring, torch)


def fit(n, sizes, seconds):
    """Lesson 6's model of a ring all-reduce of `size` bytes over n ranks,
    t = 2 (n - 1) alpha + 2 (n - 1) / n x size / B, fitted by least squares on relative errors
    (every point weighs the same on log-log axes). Returns alpha, the latency of one step, in
    seconds, and B, the bandwidth, in bytes per second (None if the times do not grow with the bytes)."""
    steps = 2 * (n - 1)
    x = torch.tensor([steps / n * size for size in sizes], dtype=torch.float64)  # bytes each rank sends
    t = torch.tensor(seconds, dtype=torch.float64)
    a = torch.stack([torch.full_like(x, steps), x], dim=1) / t[:, None]  # each row divided by its time
    alpha, inverse_b = torch.linalg.lstsq(a, torch.ones_like(t)[:, None]).solution[:, 0].tolist()
    return alpha, (1 / inverse_b if inverse_b > 0 else None)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def describe(fitted):
    bandwidth = fitted["bandwidth_bytes_per_s"]
    return (f"alpha {1e6 * fitted['alpha_s']:.1f} us a step, B "
            + (f"{bandwidth / 1e9:.3f} GB/s" if bandwidth else "not fitted"))


def report(n, sizes, medians, args):
    """The table and the fits (printed unless --quiet), and the --json file; returns the fits."""
    sent = [2 * (n - 1) * size / n for size in sizes]  # bytes each rank sends in a ring
    rows = [{"bytes": size, "sent_bytes": s, "ring_s": ring, "torch_s": gloo}
            for size, s, (ring, gloo) in zip(sizes, sent, medians.tolist())]
    fits = {}
    for j, name in enumerate(("ring", "torch")):
        alpha, bandwidth = fit(n, sizes, medians[:, j].tolist())
        fits[name] = {"alpha_s": alpha, "steps": 2 * (n - 1), "bandwidth_bytes_per_s": bandwidth}
    if not args.quiet:
        print(f"{'bytes':>11} {'sent/rank':>11} {'ms ring':>9} {'ms torch':>9} {'GB/s ring':>9} "
              f"{'GB/s torch':>10}")
        for r in rows:
            print(f"{r['bytes']:>11,} {r['sent_bytes']:>11,.0f} {1e3 * r['ring_s']:9.3f} "
                  f"{1e3 * r['torch_s']:9.3f} {r['sent_bytes'] / r['ring_s'] / 1e9:9.3f} "
                  f"{r['sent_bytes'] / r['torch_s'] / 1e9:10.3f}")
        print(f"fitted t = 2 (N - 1) alpha + 2 (N - 1) / N x bytes / B, N = {n}: {2 * (n - 1)} steps")
        for name, fitted in fits.items():
            print(f"  {name:5}: {describe(fitted)}")
    if args.json:
        machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "system": " ".join(os.uname()[:3]),
                   "python": sys.version.split()[0], "torch": torch.__version__}
        result = {"date": datetime.now().isoformat(timespec="seconds"), "machine": machine, "nprocs": n,
                  "backend": "gloo", "repeats": args.repeats,
                  "statistic": "median over the repeats of the slowest rank's time",
                  "fitted": "t = 2 (N - 1) alpha + 2 (N - 1) / N x bytes / B: alpha a step's latency, "
                            "B the bandwidth",
                  "rows": rows, "fit": fits}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return fits


# --------------------------------------------------------------------------- one rank
def worker(rank, world_size, args):
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(max(1, os.cpu_count() // world_size))
    if args.mode == "check":
        failures = check(rank, world_size, args.quiet)
        lengths = check_lengths(world_size)
        if rank == 0 and not failures:
            print(f"done: ring_all_reduce equals dist.all_reduce on {3 * len(lengths)} tensors "
                  f"(lengths {min(lengths)} to {max(lengths)}, float32, float64, int64), {world_size} "
                  f"processes, each sending 2(N-1)/N of the bytes (on average where N does not divide the "
                  f"length)", flush=True)
        dist.destroy_process_group()
        if failures:
            raise SystemExit(f"rank {rank}: ring_all_reduce differs from dist.all_reduce on {failures} "
                             f"tensors")
        return
    sizes = message_sizes(args.max_mb)
    medians = measure(rank, world_size, sizes, args.repeats, args.quiet)
    if rank == 0:
        fits = report(world_size, sizes, medians, args)
        print(f"done: timed {len(sizes)} sizes, {sizes[0]:,} to {sizes[-1]:,} bytes, {world_size} processes; "
              f"ring {describe(fits['ring'])}; torch {describe(fits['torch'])}"
              + (f"; wrote {args.json}" if args.json else ""), flush=True)
    dist.barrier()  # the ranks leave together, once rank 0 has fitted and written
    dist.destroy_process_group()


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--nprocs", type=positive(int), default=2)
    p.add_argument("--mode", choices=["check", "measure"], default="check")
    p.add_argument("--max-mb", type=positive(float), default=64, help="measure: largest message, in MiB")
    p.add_argument("--repeats", type=positive(int), default=10, help="measure: timed runs per size")
    p.add_argument("--json", type=str, default=None, help="measure: write the times and the fit here")
    p.add_argument("--quiet", action="store_true", help="only the final line (and any mismatch)")
    p.add_argument("--timeout", type=positive(int), default=120, help="seconds a collective may wait")
    args = p.parse_args(argv)
    if args.mode == "measure" and args.nprocs < 2:
        raise UsageError("--mode measure needs --nprocs 2 or more: one rank sends nothing")
    if args.mode == "measure" and len(message_sizes(args.max_mb)) < 2:
        raise UsageError(f"--max-mb {args.max_mb} leaves fewer than two sizes to fit a line to: "
                         f"give at least {16 / 2**20:.1e}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: no such folder")
    return args


if __name__ == "__main__":
    # plain: args = parse_args(); MASTER_ADDR/PORT here; mp.spawn(worker, args=(args.nprocs, args))
    run_plainly(worker, parse_args)
