"""Small helpers the notebooks share. The training code itself lives in ../ddp_scripts/.

Why launch scripts instead of calling functions: DDP starts N fresh Python processes, and each
must import the code it runs from a file. A notebook kernel has no such file (its __main__ is the
kernel), so the notebooks run the scripts in a subprocess and stream what they print.
"""
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "ddp_scripts"
DATA_DIR = REPO / "data"
OUTPUT = REPO / "notebooks" / "output"  # ignored by git: metrics, checkpoints, plots of your runs


def run(*args, check=True, memory=None):
    """Run `python <args>` from the repository root, printing its output line by line as it comes.

    run("ddp_scripts/mnist_ddp_cpu.py", "--nprocs", 2) is what you would type in a terminal.
    With memory=PeakMemory(...), the command's process tree is watched while it runs. A command
    that fails raises (check=True) or returns its exit code (check=False); one that succeeds
    returns None, so that a cell ending in run(...) shows only the command's output. With
    check=True, a course script that trains must also have printed its summary (the line that
    starts with "done:"): exit code 0 without it means it did not train to the end.
    """
    argv = [str(a) for a in args]
    print("$ python " + " ".join(shlex.quote(a) for a in argv), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # each run picks a free port
    done = False
    with start(argv, env, watched=memory is not None) as proc:
        if memory is not None:
            memory.watch(proc)
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                done = done or line.startswith("done:")
        except KeyboardInterrupt:  # the notebook's stop button: stop the run, do not wait for it
            stop(proc)
            raise
    if memory is not None:
        memory.join()
    if check and proc.returncode != 0:
        raise RuntimeError(f"the command exited with code {proc.returncode} (its output is above)")
    if check and trains(argv) and not done:
        raise RuntimeError("the script ended without its 'done:' summary line: it did not train to "
                           "the end (its output is above)")
    return None if check else proc.returncode


def start(argv, env, watched=False):
    """subprocess.Popen([python, *argv]), its output and errors as one stream of lines. In the test
    suite (COURSE_PRELOADED=1, set by tests/conftest.py), forked instead from a Python that has
    imported torch already (launcher.py, beside this file): the same run, seconds sooner. Not for a run whose
    memory is measured (its pages would be shared with that Python)."""
    if os.environ.get("COURSE_PRELOADED") == "1" and not watched:
        global LAUNCHER
        if LAUNCHER is None:
            from launcher import Launcher  # beside this file

            LAUNCHER = Launcher(existing=os.environ.get("COURSE_LAUNCHER"))  # the suite's, if it runs
        return LAUNCHER.popen(argv, env, REPO, merge=True)
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, text=True, bufsize=1,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


LAUNCHER = None
# the modules the scripts import; and lessons 2 and 3's scripts, whose launching later lessons run
COURSE_MODULES = ("ddp_hardening.py", "mnist_parts.py", "gcn_parts.py", "comm_bytes.py")
BASE_SCRIPTS = ("mnist_ddp_cpu.py", "mnist_ddp_gpu.py")


def course_imports(script):
    """The files of ddp_scripts/ that `script` imports, directly or through them: what a copy of it
    needs beside it (read from its import statements)."""
    import ast

    found, todo = set(), [script]
    while todo:
        for node in ast.walk(ast.parse((SCRIPTS / todo.pop()).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                file = f"{name.split('.')[0]}.py"
                if (SCRIPTS / file).is_file() and file not in found:
                    found.add(file)
                    todo.append(file)
    return sorted(found)


def trains(argv):
    """Whether `python <argv>` runs one of the course's training scripts, or an edited copy of one
    (directly, or through torchrun), rather than --help or some other command."""
    def course_script(arg):
        path = (REPO / arg).resolve()
        if not arg.endswith(".py"):
            return False
        if path.parent == SCRIPTS:
            return True
        # an edited copy of a training script (edited_copy), not some other small script: it prints
        # its summary itself, or through the report of mnist_parts.py or gcn_parts.py
        return path.parent == OUTPUT and path.is_file() and any(
            summary in path.read_text() for summary in ('print(f"done: ', "report.done("))

    return any(course_script(a) for a in argv) and not {"-h", "--help"} & set(argv)


def function_diff(before, after, name, context=1):
    """The unified diff of top-level function `name` between two scripts of ddp_scripts/, as text; a
    function new in `after` shows whole, as added lines."""
    import ast
    import difflib

    def source(script):
        text = lesson_text(script)
        for node in ast.parse(text).body:
            if getattr(node, "name", None) == name:
                return text.splitlines()[node.lineno - 1 - len(node.decorator_list):node.end_lineno]
        return []

    return "\n".join(difflib.unified_diff(source(before), source(after), f"{before}", f"{after}",
                                          lineterm="", n=context))


def lesson_diff(before, after, diffed=("train",), context=1):
    """What the script `after` adds to `before`, the lesson whose launching and command line it
    imports and runs: its top-level functions, classes and constants in order, those named in
    `diffed` (that `before` defines too) as their diff against `before`'s, every other one whole.
    What it takes from `before` unchanged is not repeated."""
    import ast
    import difflib

    def name(node):  # a function, a class, or a constant (NAME = ...)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
        return getattr(node, "name", None)

    def definitions(script):
        text = lesson_text(script).splitlines()
        return {name(node): text[node.lineno - 1 - len(getattr(node, "decorator_list", [])):node.end_lineno]
                for node in ast.parse("\n".join(text)).body if name(node)}

    old, new, out = definitions(before), definitions(after), []
    for name, lines in new.items():
        if name in diffed and name in old:
            out += list(difflib.unified_diff(old[name], lines, lineterm="", n=context))[2:]
        else:
            out += [f"@@ {after}: {name} @@"] + ["+" + line for line in lines]
    return "\n".join(out)


def lesson_text(script):
    """A script of ddp_scripts/ as a learner reads it: the whole file (what the DDP scripts share,
    the hardening and the MNIST and GCN pieces, is in the modules they import)."""
    return (SCRIPTS / script).read_text()


def free_port():
    """A port that nothing listens on now: a meeting point for torchrun agents started by hand. The
    scripts' own (ddp_hardening.free_port), drawn where no connection opened meanwhile can take it."""
    sys.path.insert(0, str(SCRIPTS))
    import ddp_hardening

    return ddp_hardening.free_port()


def run_machines(commands, timeout=600, interleave=True, on_line=None):
    """Start one `python <args>` per entry of `commands` (a dict: a machine's name -> its args) at
    once, as if each ran on a machine of its own, and print their lines as they come, each tagged
    with its machine (interleave=False: each machine's lines in one block, once all have ended).
    on_line(line), if given, is called with each tagged line as it comes (to act on what a machine
    says). Waits for all (at most `timeout` seconds); returns {name: exit code}."""
    import queue
    import threading
    import time

    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    lines, procs = queue.Queue(), {}
    for name, args in commands.items():
        argv = [str(a) for a in args]
        print(f"[{name}] $ python " + " ".join(shlex.quote(a) for a in argv), flush=True)
        procs[name] = start(argv, env)

    def read(name, proc):
        for line in proc.stdout:
            lines.put(f"[{name}] {line}")

    readers = [threading.Thread(target=read, args=item, daemon=True) for item in procs.items()]
    for reader in readers:
        reader.start()
    deadline, held = time.monotonic() + timeout, []
    try:
        while any(r.is_alive() for r in readers) or not lines.empty():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the machines ran longer than {timeout} s")
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if interleave:
                print(line, end="", flush=True)
            else:
                held.append(line)
            if on_line is not None:
                on_line(line)
    except (KeyboardInterrupt, TimeoutError):
        for proc in procs.values():
            stop(proc)
        raise
    finally:
        for name in procs:  # stable: a machine's lines keep their order
            print("".join(line for line in held if line.startswith(f"[{name}] ")), end="", flush=True)
    return {name: proc.wait() for name, proc in procs.items()}


def stop(proc, grace=10):
    """Stop a command started by run() and every process it started: Ctrl-C (SIGINT) to all of
    them, as a terminal would, then SIGKILL for whatever is left after `grace` seconds."""
    import signal

    import psutil

    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    for process in started:
        try:
            process.send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            pass
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)  # the launcher is reaped by Popen, which then knows its exit code
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(started, timeout=1)
    for process in alive:  # ranks or workers that ignored Ctrl-C
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    print(f"\nstopped (exit code {proc.returncode})", flush=True)


class PeakMemory:
    """Peak memory of a whole job (launcher and every process it starts), counting shared pages
    once: the sum of each process's PSS (proportional set size: a page shared by k processes
    counts 1/k in each), sampled every `interval` seconds in a thread (reading a process's page
    map takes CPU time, hence not more often). `peak` is over the whole
    run; `peak_with_workers` only while at least `workers` child processes exist (for a job whose
    launcher works alone before it starts the workers)."""

    def __init__(self, workers=1, interval=0.5):
        self.workers, self.interval = workers, interval
        self.peak = self.peak_with_workers = 0
        self._thread = None

    def watch(self, proc):
        import threading

        self._thread = threading.Thread(target=self._sample, args=(proc,), daemon=True)
        self._thread.start()

    def join(self):
        self._thread.join()

    def _sample(self, proc):
        import time

        import psutil

        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while proc.poll() is None:
            try:
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            total = 0
            for p in [root, *children]:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak = max(self.peak, total)
            if len(children) >= self.workers:
                self.peak_with_workers = max(self.peak_with_workers, total)
            time.sleep(self.interval)


def gcn_steps_in_one_process(gcn, data, split, args, world_size, one_subgraph=False):
    """The optimizer steps that `world_size` ranks of gcn_ddp.py take, taken by one process.

    At each step: the seed nodes each rank would train on (its chunk from `rank_chunk`, batch by
    batch), one sampled subgraph per rank, the mean of the ranks' losses, one optimizer step.
    That is what DDP computes: each rank's backward() averages the gradients of all ranks.
    With one_subgraph=True the same seeds are sampled as ONE batch instead. Needs nothing random:
    args.dropout 0 and args.num_neighbors all -1 (every neighbour). `gcn` is the imported script,
    `data` the graph after gcn.prepare_graph. Returns the final state_dict.
    """
    import torch
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.sampler import NeighborSampler

    assert args.dropout == 0 and set(args.num_neighbors) == {-1}, "sampling and dropout are random"
    torch.manual_seed(args.seed)  # the ranks' initial weights
    model = gcn.GCN(data.num_features, args.hidden, int(data.y.max()) + 1, args.dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    chunks = [gcn.rank_chunk(split["train"], 1, rank, world_size, args.seed, not args.no_shuffle)
              for rank in range(world_size)]
    assert args.max_steps * args.batch_size <= len(chunks[0]), "one epoch only"
    size = args.batch_size
    sampler = NeighborSampler(data, num_neighbors=args.num_neighbors, is_sorted=True)  # as the ranks
    for step in range(args.max_steps):
        seeds = [chunk[step * size:(step + 1) * size] for chunk in chunks]  # rank r's batch
        groups = [torch.cat(seeds)] if one_subgraph else seeds
        optimizer.zero_grad()
        loss = 0
        for nodes in groups:
            loader = NeighborLoader(data, num_neighbors=args.num_neighbors, input_nodes=nodes,
                                    batch_size=len(nodes), neighbor_sampler=sampler)
            batch = next(iter(loader))
            out = model(batch.x, batch.edge_index)[:batch.batch_size]  # seed nodes only
            loss = loss + gcn.loss_fn(out, batch.y[:batch.batch_size]) / len(groups)
        loss.backward()
        optimizer.step()
    return model.state_dict()


def data_args(smoke, dataset="auto"):
    """The data flags of the lessons' runs: the dataset prepared in ../data (downloaded once, or
    Fashion-MNIST offline); in smoke mode its first 6,000 training and 1,000 test images, in the
    same format, in ../data/smoke (every run then loads and scores a tenth of the data)."""
    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts

    dataset = mnist_parts.prepare_data(dataset, str(DATA_DIR), verbose=False)
    folder = small_copy(dataset, DATA_DIR / "smoke") if smoke else DATA_DIR
    return ["--dataset", dataset, "--data-dir", str(folder)]


def small_copy(dataset, folder, train=6000, test=1000):
    """The first `train` training and `test` test images of `dataset` (prepared in ../data), written
    once into `folder` in the dataset's own files and layout; returns the folder."""
    import struct

    sys.path.insert(0, str(SCRIPTS))
    import mnist_parts

    raw = Path(mnist_parts.raw_dir(dataset, str(folder)))
    source = Path(mnist_parts.raw_dir(dataset, str(DATA_DIR)))
    raw.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("t10k", test)):
        for kind in ("images-idx3", "labels-idx1"):
            target = raw / f"{split}-{kind}-ubyte"
            if target.exists():
                continue
            values = mnist_parts.read_idx(str(source / target.name))[:count].contiguous()
            part = target.with_name(f"{target.name}.{os.getpid()}.part")
            with open(part, "wb") as f:  # IDX: 0, 0, 8 (unsigned bytes), the dimensions, the sizes
                f.write(struct.pack(">HBB", 0, 0x08, values.dim()))
                f.write(struct.pack(f">{values.dim()}I", *values.shape))
                f.write(values.numpy().tobytes())
            os.replace(part, target)  # whole or not at all: runs may read it at once
    return folder


def output_path(name):
    """A path under notebooks/output/ for --metrics-json, --save or a plot."""
    OUTPUT.mkdir(exist_ok=True)
    return OUTPUT / name


def read_json(path):
    with open(path) as f:
        return json.load(f)


def edited_copy(script, edits, name, modules=None):
    """A copy of ddp_scripts/<script>, changed for an experiment, in notebooks/output/<name>.py,
    with the files it imports beside it (course_imports); the course's files stay as they are.
    `edits`: pairs (old, new) of text, each `old` found exactly once (else ValueError: the script
    has changed, and the experiment must follow it). `modules`: {file: edits} for the copies of
    those files (e.g. {"mnist_parts.py": [...]}, or lesson 3's script), which hold until the next
    edited_copy. Prints each change as a diff; returns the copy's path, to run() like any script."""
    import difflib

    def edited(file, changes, target):
        source = (SCRIPTS / file).read_text()
        text = source
        for old, new in changes:
            if text.count(old) != 1:
                raise ValueError(f"{file}: {old!r} occurs {text.count(old)} times, not once")
            text = text.replace(old, new)
        target.write_text(text)
        if changes:
            print("\n".join(difflib.unified_diff(source.splitlines(), text.splitlines(),
                                                 f"ddp_scripts/{file}", str(target.relative_to(REPO)),
                                                 lineterm="", n=1)))

    path = output_path(f"{name}.py")
    edited(script, edits, path)
    for module in course_imports(script):  # what the copy imports, beside it (as Python looks for it)
        edited(module, (modules or {}).get(module, []), output_path(module))
    return path


def max_diff(a, b):
    """The largest absolute difference between two state_dicts, over every weight."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Captured(io.StringIO):
    """What a cell prints: shown as usual, and kept for the asserts (run() and run_machines()
    print their commands' output line by line, and return only exit codes)."""

    def __init__(self, shown):
        super().__init__()
        self.shown = shown

    def write(self, text):
        self.shown.write(text)
        return super().write(text)

    def flush(self):
        self.shown.flush()

    @property
    def text(self):
        return self.getvalue()


@contextlib.contextmanager
def captured():
    """with captured() as out: run(...); then out.text holds what was printed."""
    out = Captured(sys.stdout)
    with contextlib.redirect_stdout(out):
        yield out


def run_captured(*args, **kwargs):
    """run(), and also the text the command printed, for the asserts: (run's result, text)."""
    with captured() as out:
        result = run(*args, **kwargs)
    return result, out.text


# torch's flight-recorder analyser (the `torchfrtrace` command) compares every rank with the first
# file it reads, and reads a folder in the order the file system lists it: here in rank order.
_FR_TRACE = """import os, re, sys
walk = os.walk
def number_order(name):  # rank_2 before rank_10
    return [int(t) if t.isdigit() else t for t in re.split(r"(\\d+)", name)]
def in_rank_order(top, *args, **kwargs):
    for root, dirs, files in walk(top, *args, **kwargs):
        yield root, dirs, sorted(files, key=number_order)
os.walk = in_rank_order
from torch.distributed.flight_recorder.fr_trace import main
main(sys.argv[1:])
"""


def torchfrtrace(folder, show=True):
    """`torchfrtrace FOLDER` (torch's analyser of flight-recorder files) with rank 0 as its reference.
    Prints the report without torch's own stack frames (show=True); returns it whole."""
    out = subprocess.run([sys.executable, "-c", _FR_TRACE, str(folder)], capture_output=True, text=True,
                         timeout=120)
    report = out.stdout + out.stderr
    if show:
        print("\n".join(line for line in report.splitlines()
                        if (" at /" not in line or str(SCRIPTS) in line or str(OUTPUT) in line)
                        and "tabulate" not in line))  # an optional package's note
    return report
