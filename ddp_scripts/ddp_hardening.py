"""The hardening of the course's DDP scripts, written once: what keeps a job safe on a real cluster.

Every DDP script of the course imports it (with template_ddp.py, the two files are a project's
start). A script calls it in a handful of places, each marked with the plain code it stands for:

    run_main(main, parse_args)                 main(parse_args()), every ending said in one line
    spawn_workers(worker, nprocs, *args)       mp.spawn(worker, args=(nprocs, *args), nprocs=nprocs)
    roll_call(check, args, rank, world_size)   check(args, rank), answered by every rank under torchrun
    prepare_in_turns(prepare, first, rank, timeout)   prepare(first), one process at a time
    attempt_store(timeout)                     nothing: init_process_group's own store
    master_port()                              str(free_port())
    progress(steps, desc, show)                tqdm(steps, desc=desc, leave=False, disable=not show)
    check_device(device, backend, amp, nprocs, gpu)   nothing: refuses a GPU set-up that cannot work
    add_hardening_flags(parser)                parser.add_argument("--timeout", ...), and --prepare-timeout
    save_whole(obj, path)                      torch.save(obj, path), never half a file

It takes what it needs as arguments (the script's main, parse_args, worker, checks), never reaching
into the script that imports it; parse_args(argv) returns a Namespace with `timeout`. A UsageError
raised anywhere ends the job in one line (exit code 1; 2 from the parser). Besides: the command
line's pieces (UsageError, Parser, positive, cpu_cores, check_writable, write_metrics, free_port),
and run_plainly for the by-hand scripts. Why each piece exists: docs/decisions/."""
import argparse
import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # its default lock, a semaphore, leaks if a process is killed
except ImportError:  # the progress bar is optional
    def tqdm(iterable, **kwargs):
        return iterable


# --------------------------------------------------------------------------- the command line
class UsageError(Exception):
    """Something the user can fix: raise it anywhere for a one-line error, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, described by the first line of `doc` (a script's __doc__): a mistake is one
    line, no flag abbreviated, and a flag defined again replaces the first (a later lesson's own)."""

    def __init__(self, doc, **kwargs):
        super().__init__(description=doc.strip().splitlines()[0], allow_abbrev=False,
                         conflict_handler="resolve", **kwargs)

    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{message} (see --help)")


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def cpu_cores(shared_by=None):
    """The cores this process may run on; with shared_by, the processes of this machine (torchrun's
    LOCAL_WORLD_SIZE where it is set), each one's share of them, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores if shared_by is None else max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", shared_by)))


def check_writable(*paths):
    """Refuse now, not after training, an output that cannot be written; create missing folders."""
    for path in filter(None, paths):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot write {path}: cannot create {folder} ({err.strerror})") from None
        if not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write {path}: no write permission in {folder}")


def write_metrics(path, metrics):
    """The metrics JSON, written whole (a new file renamed over the old)."""
    with open(f"{path}.part", "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(f"{path}.part", path)


def save_whole(obj, path):
    """torch.save(obj, path), never half a file: written under a name of this host and process, then
    renamed (atomic); a failed write leaves nothing behind."""
    part = f"{path}.{socket.gethostname()}.{os.getpid()}.part"
    try:
        with open(part, "wb") as f:  # (a Python file: failures are OSErrors with a reason)
            torch.save(obj, f)
        os.replace(part, path)
    except BaseException:
        if os.path.isfile(part):
            os.remove(part)
        raise


def free_port():
    """A free port for rank 0, drawn below the range Linux hands out for port 0 and outgoing
    connections (ip_local_port_range), so that none takes it before rank 0 binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            below = range(20000, int(f.read().split()[0]))  # empty when that range starts lower
    except OSError:  # not Linux
        below = range(0)
    for port in random.SystemRandom().sample(below, min(len(below), 50)) + [0]:  # 0: the OS picks
        with socket.socket() as s, contextlib.suppress(OSError):  # in use: the next
            s.bind(("", port))
            return s.getsockname()[1]


# --------------------------------------------------------------------------- the hardening
def check_device(device, backend=None, amp="off", nprocs=1, gpu=0):
    """Refuse, before any process starts, what --device, --backend (None: no such flag), --amp and
    --nprocs cannot do here. gpu: this process's GPU, by index (with none, CUDA starts on GPU 0)."""
    if device == "cpu":
        if backend == "nccl":
            raise UsageError("NCCL needs CUDA tensors: use --backend gloo with --device cpu")
        if amp == "fp16":
            raise UsageError("--amp fp16 is for GPUs here: use --amp bf16 (or off) with --device cpu")
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise UsageError("no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); to run "
                         f"on CPU instead: {'--backend gloo ' if backend else ''}--device cpu")
    if backend == "nccl" and not dist.is_nccl_available():
        raise UsageError("this PyTorch build has no NCCL: install a CUDA build of torch, "
                         "or use --backend gloo")
    gpus, procs = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", nprocs))
    if procs > gpus:
        raise UsageError(f"{procs} processes but {gpus} visible GPU(s): each rank needs a GPU of its own, "
                         f"so use --nprocs {gpus} (or --nproc-per-node {gpus})")
    if gpu >= gpus:  # before asking about it: asking about a GPU that is not there fails
        raise UsageError(f"LOCAL_RANK={gpu}, but this process sees {gpus} GPU(s): every rank must see all of "
                         f"its machine's GPUs (Slurm: --gpus-per-node, not --gpus-per-task)")
    if amp == "bf16" and torch.cuda.get_device_capability(gpu) < (8, 0):
        raise UsageError(f"{torch.cuda.get_device_name(gpu)} has no native bf16 (before compute "
                         f"capability 8.0 it is emulated, slowly): use --amp fp16")


def add_hardening_flags(parser, prepare=True):
    parser.add_argument("--timeout", type=positive(int), default=300,
                        help="seconds any collective may wait for the other ranks before failing")
    if prepare:  # prepare_in_turns()'s timeout
        parser.add_argument("--prepare-timeout", type=positive(int), default=3600,
                            help="under torchrun: seconds a rank may wait while others download "
                                 "and prepare the data")
    # torch.distributed.launch and DeepSpeed pass it; LOCAL_RANK, which they set too, is what counts.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def progress(steps, desc, show):
    """The steps of an epoch, their progress shown when `show`: tqdm's bar in a terminal; elsewhere
    (a notebook, a log) at most a line every 5 s and 20 an epoch: "  [epoch 1] 40/94 steps, 1,234
    samples/s, 12 s left" (never "epoch 1: ...", which starts the epoch's own summary)."""
    if not show:
        return steps
    if sys.stdout.isatty():
        return tqdm(steps, desc=desc, leave=False)
    return progress_lines(steps, desc)


def progress_lines(steps, desc):
    total, start, last, said, samples = len(steps), time.monotonic(), time.monotonic(), 0, 0
    for done, step in enumerate(steps, 1):
        yield step
        size = getattr(step, "batch_size", None)  # a graph batch's seed nodes
        first = next(iter(step.values())) if isinstance(step, dict) else (
            step[0] if isinstance(step, (tuple, list)) else step)
        samples += size if isinstance(size, int) else len(first)
        now = time.monotonic()
        if now - last >= 5 and said < 20 and done < total:
            print(f"  [{desc}] {done}/{total} steps, {samples / (now - start):,.0f} samples/s, "
                  f"{(total - done) * (now - start) / done:.0f} s left", flush=True)
            last, said = now, said + 1


def master_port():
    """A port for rank 0: the user's MASTER_PORT if it is free (a busy one refused now in one line,
    not by every worker with a traceback), else a free one."""
    if "MASTER_PORT" not in os.environ:
        return str(free_port())
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise UsageError(f"MASTER_PORT={port} is already in use: choose another port "
                             f"or unset MASTER_PORT to let the script pick a free one") from None
    return str(port)


def attempt_store(timeout):
    """torchrun restarts the ranks (--max-restarts) in the store where the last round's ranks wrote
    their addresses: a rank that reads one connects to a process that is gone (pytorch/pytorch#135712).
    Each round gets keys of its own; None (no agents' store): init_process_group's own store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, token = this_round(timeout)
    return dist.PrefixStore(f"round-{token}/", store)


_ROUND = []  # (agent's store, this round's token), once per process


def this_round(timeout):
    """torchrun: a client of the agents' store, and a token that every rank of this rendezvous round
    gets, and no rank of another. Not TORCHELASTIC_RESTART_COUNT: an agent whose ranks restarted
    because another machine failed does not count it (pytorch/pytorch#108158). Rank 0 draws the
    token; every other rank writes fresh numbers under its key until rank 0 has seen one change (a
    rank of an earlier round is gone, its number old) and answered it with the token."""
    if _ROUND:
        return _ROUND[0]
    import uuid

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    prefix, deadline = f"round/{os.environ.get('TORCHELASTIC_RUN_ID')}/", time.monotonic() + timeout

    def read(key):
        return store.get(key) if store.check([key]) else None

    if rank == 0:
        token = uuid.uuid4().hex
        earlier = {r: read(f"{prefix}hello/{r}") for r in range(1, world_size)}
        while earlier:
            for r, before in list(earlier.items()):
                now = read(f"{prefix}hello/{r}")
                if now is not None and now != before:  # written by a live rank of this round
                    store.set(f"{prefix}answer/{r}", now + b" " + token.encode())
                    del earlier[r]
            if earlier and time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(earlier)} did not report within {timeout} s")
            time.sleep(0.05)
    else:
        mine = set()
        while True:
            number = uuid.uuid4().hex.encode()
            mine.add(number)
            store.set(f"{prefix}hello/{rank}", number)
            time.sleep(0.05)
            answer = read(f"{prefix}answer/{rank}")
            if answer and answer.split(b" ")[0] in mine:
                token = answer.split(b" ")[1].decode()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not answer within {timeout} s")
    _ROUND.append((store, token))
    return _ROUND[0]


def roll_call(check, args, rank, world_size, timeout=None):
    """torchrun: every rank runs check(args, rank) (GPUs, libraries, output paths) and tells all the
    others how it went, through torchrun's store, before any rank joins the group: a refusal on one
    machine stops every rank within seconds (exit code 1), said once by rank 0, where the others
    would wait --timeout for a rank that has gone."""
    timeout = timeout or args.timeout
    problem = ""
    try:
        check_network()
        check(args, rank)
    except UsageError as err:
        problem = str(err) if rank == 0 else f"{err} (rank {rank}, on {socket.gethostname()})"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # RANK set by hand: no store yet
        if problem:
            say(problem)
            sys.exit(1)
        return
    try:
        store, token = this_round(timeout)  # keys of this rendezvous round only
        prefix = f"roll-call/{token}/"
        keys = [f"{prefix}{r}" for r in range(world_size)]
        store.set(keys[rank], problem)
        store.wait(keys)  # every rank has reported
        problems = [p for p in (store.get(key).decode() for key in keys) if p]
        store.add(prefix + "read", 1)
        # Stay until all have read them: the store lives in rank 0's torchrun, gone when a rank ends.
        deadline = time.monotonic() + timeout
        while problems and store.add(prefix + "read", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # torch's DistError: a rank did not report in time, or the store is gone
        if problem or int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per machine
            say(problem or f"not every rank reported for the roll call (waited up to --timeout "
                           f"{timeout} s): look for the error in each machine's output")
            sys.exit(1)
        exit_after_the_speaker()
    if problems:
        # Rank 0 says the first; torchrun --max-restarts starts a refused job again, to be refused
        # again: only the first attempt says it.
        said = f"roll-call/{os.environ.get('TORCHELASTIC_RUN_ID')}/said/{problems[0]}"
        if rank == 0:
            if store.add(said, 1) == 1:
                say(problems[0])
            sys.exit(1)
        exit_after_the_speaker()


def prepare_in_turns(prepare, first, rank, timeout):
    """torchrun: run prepare(choice) in every rank, in three turns, so that no two processes ever
    download into one folder at once. Rank 0 goes first, with choice=first, and decides (e.g. what
    --dataset auto means) the choice of every later turn. Then the first process of each other
    machine, which downloads only where rank 0's files are not visible (no shared filesystem); then
    all the others. A turn ends when every rank knows it went well; a UsageError in any rank stops
    all of them with its one line. A download can outlast --timeout: the turns run in a Gloo group
    of their own with `timeout` (--prepare-timeout), the waiting ranks on the CPU, not in a GPU
    collective. Returns rank 0's choice."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    outcomes, choice = [None] * dist.get_world_size(), first
    try:
        for turn, mine in enumerate([rank == 0, rank != 0 and local_rank == 0, local_rank != 0]):
            error = None
            if mine:
                try:
                    choice = prepare(choice)
                except UsageError as err:
                    error = f"{err} (on {socket.gethostname()})" if turn == 1 else str(err)
            dist.all_gather_object(outcomes, (error, choice), group=group)
            errors = [e for e, _ in outcomes if e]
            if errors:
                raise UsageError(errors[0])
            choice = outcomes[0][1]  # rank 0's decision, for every rank
    finally:
        dist.destroy_process_group(group)
    return choice


def quiet_interrupt_in_finalizer(unraisable):
    """A Ctrl-C during a finalizer (a __del__) cannot stop the worker: Python prints "Exception
    ignored in ..." and goes on. Say nothing (the launcher sends a SIGINT of its own); else as usual."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def spawned_worker(rank, worker, stop, *worker_args):
    """What mp.spawn runs in each new process. spawn_workers started it deaf to Ctrl-C: listen again
    now, and stop at once if the job was interrupted meanwhile; then work, an error said once."""
    import signal

    sys.unraisablehook = quiet_interrupt_in_finalizer
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the launcher's handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not stop.is_set():
            try:
                worker(rank, *worker_args)
            except UsageError as err:
                said_once(err, rank)
        code = 0
    except SystemExit as exit_:  # said_once's exit code
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        # Deaf again: an interrupted worker gets a second SIGINT (the terminal's, then the launcher's),
        # which would print a traceback on the way out, after mp.spawn's wrapper caught the first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_sooner()
    leave(code)  # an exception other than SystemExit went on to mp.spawn's wrapper, its traceback


def native_threads():
    """This process's threads as the kernel counts them (Python's misses torch's); None: no /proc."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


THREADS_AFTER_IMPORTS = native_threads()  # when first imported: a script imports torch before it


def start_method():
    """How spawn_workers starts the workers: "fork" where safe (torch already imported: seconds
    sooner), else "spawn" (mp.spawn's). Fork copies only the calling thread: safe when no thread has
    started since the imports (a forked worker would hang in an OpenMP pool started here) and there
    is no GPU (CUDA is unusable in a child forked after use). DDP_START_METHOD=... decides instead."""
    chosen = os.environ.get("DDP_START_METHOD")
    if chosen:
        if chosen not in mp.get_all_start_methods():
            raise UsageError(f"DDP_START_METHOD={chosen} is not one of "
                             f"{', '.join(mp.get_all_start_methods())} (or unset it)")
        return chosen
    if THREADS_AFTER_IMPORTS is not None and native_threads() == THREADS_AFTER_IMPORTS \
            and "fork" in mp.get_all_start_methods() and not torch.cuda.is_available():
        return "fork"
    return "spawn"


def exit_sooner():
    """Python's last garbage collection at exit walks every object torch's imports made (about a
    second): frozen, they are left to the OS. Finalizers, atexit functions, flushing still run."""
    import gc

    gc.freeze()


def leave(code):
    """End this process with exit code `code` as multiprocessing ends a forked worker (os._exit),
    after the atexit functions and flushing, without Python's shutdown: there, before 3.14, a torch
    thread calling into Python (a Gloo thread freeing a tensor) is ended inside C++ and the process
    aborts, "terminate called without an active exception" (CPython gh-87135). Close files first."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_network():
    """GLOO_SOCKET_IFNAME, the interfaces Gloo binds to: one this machine lacks would stop each rank
    in init_process_group with a C++ traceback."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if not names or not hasattr(socket, "if_nameindex"):
        return
    present = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in names if name not in present]
    if missing:
        raise UsageError(f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}: this machine has no "
                         f"network interface {', '.join(missing)} (it has {', '.join(present)}): name "
                         f"the interface of the network that the machines share, or unset it")


def spawn_workers(worker, nprocs, *worker_args):
    """mp.spawn(worker, args=(nprocs, *worker_args), nprocs=nprocs), started as start_method() says,
    ending whole: a failing worker makes mp.spawn stop the others, and Ctrl-C or SIGTERM here stops
    them too (mp.spawn's own join would wait while they train on)."""
    import logging
    import signal

    check_network()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` behaves like Ctrl-C
    # mp.spawn logs "Terminating process ..." for each worker it stops: the one line here says it.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    method = start_method()
    if method == "fork":  # DDP's constructor imports torch._dynamo (~1 s): once here, not per worker
        import torch._dynamo  # noqa: F401
    stop = mp.get_context(method).Event()  # set when interrupted, for workers still starting
    try:
        # The workers start deaf to Ctrl-C (ignored stays ignored in a new process): no traceback from
        # a Ctrl-C while they import torch. They listen again in spawned_worker; this one stops them.
        listening = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            workers = mp.start_processes(spawned_worker, args=(worker, stop, nprocs, *worker_args),
                                         nprocs=nprocs, join=False, start_method=method)
        finally:
            signal.signal(signal.SIGINT, listening)
        while not workers.join():  # True once all have finished; raises when one has failed
            pass
    except KeyboardInterrupt:  # pass it on to the workers started; kill any left after 10 s
        stop.set()  # first: a worker still starting sees it once it listens, the others get SIGINT
        started, deadline = mp.active_children(), time.monotonic() + 10
        for process in started:
            os.kill(process.pid, signal.SIGINT)
        for process in started:
            process.join(max(0, deadline - time.monotonic()))  # 10 s for all, not 10 s each
            if process.is_alive():
                process.kill()
        raise
    except mp.ProcessExitedException as err:  # a worker died or failed; spawn stopped the others
        if err.error_index == 0 and err.exit_code == 1:  # rank 0 has printed why, in one line
            sys.exit(1)
        how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
        raise UsageError(f"worker {err.error_index} ended with {how}; the other workers were "
                         f"stopped") from None
    except mp.ProcessRaisedException as err:  # an unexpected exception: show its traceback
        print(err, file=sys.stderr)
        raise UsageError("a worker raised the exception above; the other workers were stopped") \
            from None


def run_plainly(worker, parse_args):
    """The by-hand scripts' plain launch: args = parse_args() (a mistake said in one line), rank 0
    on this machine, mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)."""
    try:
        args = parse_args()
    except UsageError as err:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)


def die_with_parent(parent_pid, worker_id=None):
    """On Linux, have the kernel kill this process when its parent dies: a rank when its torchrun
    agent dies (else it trains on, and the other machines wait for it), a sampling worker when its
    rank dies (else it holds the output and the shared graph). worker_id: for worker_init_fn."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before that took effect
            os._exit(1)


def say(problem):
    print(f"{os.path.basename(sys.argv[0])}: error: {problem}", file=sys.stderr, flush=True)


def said_once(err, rank):
    """An error that every rank may have met: rank 0 says it, in one line."""
    if rank == 0:
        say(err)
        sys.exit(1)
    exit_after_the_speaker()


def exit_after_the_speaker():
    """Exit code 1, quietly, after the rank that says why (the launcher, or torchrun, stops a job's
    processes as soon as one has ended: that rank might not have spoken yet)."""
    time.sleep(2)
    sys.exit(1)


def run_main(main, parse_args, argv=None):
    """main(parse_args(argv)), every way it can end said in one line: a mistake in the command line
    (exit code 2; under torchrun it answers the roll call, so a typo on one machine stops them all),
    an error found by a check or the workers (1), Ctrl-C or SIGTERM (130). It ends through leave():
    after an error too, torch's threads are there to abort Python's shutdown (decision 8)."""
    try:
        end_in_one_line(main, parse_args, argv)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
    except BaseException:  # a bug: its traceback, then the same safe exit
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)


def end_in_one_line(main, parse_args, argv):
    """run_main's work: returns when main has finished; every other ending raises SystemExit with
    its exit code, after its one line."""
    rank = int(os.environ.get("RANK", 0))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank that torchrun's agent started: end with it
        die_with_parent(os.getppid())
    try:
        args = parse_args(argv)
    except UsageError as err:
        problem = str(err)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            def refuse(args, rank):
                raise UsageError(problem)
            # 300: the parser's default --timeout, since this command line's own cannot be read.
            roll_call(refuse, None, rank, int(os.environ["WORLD_SIZE"]), timeout=300)
        say(problem)
        sys.exit(2)
    try:
        main(args)
    except UsageError as err:
        if "RANK" in os.environ:  # torchrun: every rank may have met it; rank 0 says it
            said_once(err, rank)
        say(err)
        sys.exit(1)
    except RuntimeError as err:  # torch's DistError too
        import re

        lost = re.search(r"Connection (?:closed|reset) by peer(?: \[[^]]*\](?::\d+)?)?|Broken pipe", str(err))
        unreachable = re.search(r"connectFullMesh failed with (?:\[[^]]*\] )?([^$\n]*)", str(err))
        # Silence, not a closed connection: a machine whose network or power went, or a stuck rank.
        silent = re.search(r"Timed out waiting \d+ms for \w+ operation to complete", str(err))
        if not (lost or unreachable or silent) or "RANK" not in os.environ:  # a bug: its traceback,
            raise                                                   # reported by mp.spawn's launcher
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:  # one line per machine
            exit_after_the_speaker()
        if lost:
            say(f"rank {rank} lost its connection to another rank ({lost[0]}): a process or a "
                f"machine of this job has gone; the first error in each machine's output says which")
        elif silent:
            say(f"rank {rank} on {socket.gethostname()} heard nothing from another rank within the timeout "
                f"({silent[0]}): a machine of this job is off the network or down, or a rank is stuck "
                f"(lesson 8's watchdog shows where); raise --timeout if one step can take longer")
        else:  # Gloo's ranks did not reach each other
            loopback = "remote=[127." in str(err)
            say(f"rank {rank} on {socket.gethostname()} could not connect to the other ranks "
                f"({unreachable[1].strip()}): "
                + ("a rank gave a loopback address (its machine's GLOO_SOCKET_IFNAME is lo, or its "
                   "hostname resolves to 127.0.1.1 in /etc/hosts); " if loopback else "")
                + "set GLOO_SOCKET_IFNAME on every machine to the interface of the network they share")
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; any workers have been stopped
        if rank == 0:  # under torchrun, one line from rank 0
            print(f"{os.path.basename(sys.argv[0])}: interrupted; all workers stopped", file=sys.stderr)
        sys.exit(130)
