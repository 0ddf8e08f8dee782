"""A Python with torch already imported, from which the tests' launches are forked.

It lives beside course_helpers.py, which launches through it when the notebooks run under the test
suite (COURSE_PRELOADED=1, COURSE_LAUNCHER: the suite's running server); a reader's own run never
uses it. The tests import it from here (tests/ uses notebooks/, never the reverse).

A script launched by a test pays about 3 s before its first line runs (the interpreter and `import
torch`), and a DDP rank 2 s more (DDP's constructor imports `torch._dynamo`). The suite launches
scripts a few hundred times, and each launch starts two or three ranks. This server imports them
once; each launch is a child forked from it, which then runs the script exactly as `python script.py
args...` would (`runpy`, `__main__`, `sys.argv`, the environment, the working folder, its own
session, standard input from /dev/null, output to files) and exits through the interpreter's usual
exit. The ranks it starts start from it too, keeping what their launcher promises them:

- **mp.spawn** (the spawn start method): the new process is forked from the launching one, then
  made what a new interpreter would be: the process object and its arguments pickled in the
  parent (an argument spawn cannot pickle fails as it would), the main script imported again as
  `__mp_main__` (its `if __name__ == "__main__":` block not run), signal handlers and torch's
  random state and thread count as at start-up. Only while the launching process has no thread
  but its main one and no CUDA (a fork would inherit a half-copied OpenMP pool or CUDA context):
  otherwise a real spawn. It ends as a forked process does (its atexit functions and flushed
  output, then os._exit), not through the interpreter's shutdown.
- **torchrun's ranks** (`python -u script.py ...`, each in a session of its own): forked from a
  *zygote*, a child of the agent forked before the agent starts any thread, which dies with the
  agent (so ranks that end with their parent still end with the agent), and which reports each
  rank's exit code to the agent; the agent signals, polls and waits for its ranks as usual.

What differs from new interpreters: the modules imported here are already imported, and a
spawned process does not go through the interpreter's shutdown. Tests about start-up itself, about
the interpreter's shutdown, or that need a new interpreter for another reason, launch with
`fresh=True` (helpers.run_script); `COURSE_PRELOADED=0` makes every launch do so.

Protocol, over a Unix socket: a request is one JSON line {"argv", "env", "cwd", "out", "err"}; the
answer is the child's pid. When a child ends, the server writes its exit code (negative: the signal
that ended it) to `<status folder>/<pid>`.

    python notebooks/launcher.py SOCKET STATUS_FOLDER
"""
import itertools
import json
import os
import runpy
import signal
import socket
import sys

WRITES = itertools.count()  # a name of its own for each status file that reap() writes


def reap(signum, frame):
    """SIGCHLD: record the exit code of every child that has ended, then reap it. In that order:
    until its code is recorded, a child's poll() says it runs, and its pid (a zombie) must still
    take a signal (torchrun's agent signals a rank's process group when poll() says it runs; its
    own children stay zombies until it polls them, so a rank reaped first made killpg fail).
    A SIGCHLD that arrives while this runs calls it again inside itself (Python runs a handler
    between any two bytecodes), and that inner call may record and reap the child the outer one
    is handling: so each write goes through a file of its own, and a child reaped already is
    passed over (sharing one ".part" file, the outer call once found it moved away, and the
    FileNotFoundError ended the server and every launch after it)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # look, not reap
        except ChildProcessError:
            return
        if info is None:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        path = os.path.join(STATUS, str(info.si_pid))
        part = f"{path}.{next(WRITES)}.part"
        with open(part, "w") as f:
            f.write(str(code))
        os.replace(part, path)
        try:
            os.waitpid(info.si_pid, 0)  # now reap it
        except ChildProcessError:  # an inner call reaped it first
            pass


def run(request, stdio=()):
    """In the forked child: become `python <argv>`, run it, exit as it would. stdio: file
    descriptors for standard output and error, instead of the request's files."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stdio:
        for fd, target in zip((1, 2), stdio):
            os.dup2(target, fd)
            os.close(target)
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_APPEND),
                           (2, request["err"], os.O_WRONLY | os.O_APPEND)):  # out and err may be one file
        if path is None:  # kept as inherited
            continue
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    if "TORCH_LOGS" in os.environ:  # torch reads it when imported, which this Python did before
        import torch._logging._internal

        torch._logging._internal._init_logs()
    os.chdir(request["cwd"])
    import multiprocessing.process  # where a spawned child resolves a relative script path from

    multiprocessing.process.ORIGINAL_DIR = os.path.abspath(request["cwd"])
    argv = list(request["argv"])
    if argv[0] == "-u":  # unbuffered output, as torchrun starts its ranks
        import io

        argv = argv[1:]
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    if argv[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        ranks_from_a_zygote()
    spawn_from_this_python()
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = 130
    except BaseException:  # as Python itself: the traceback, exit code 1
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # the interpreter's own exit: atexit functions, flushed streams


# --------------------------------------------------------------------------- mp.spawn from here
def native_threads():
    return len(os.listdir("/proc/self/task"))


def spawn_from_this_python():
    """Processes started with the spawn method start from this Python (see the docstring above).
    multiprocessing looks its spawn Popen up at every start: replaced here."""
    import multiprocessing.popen_spawn_posix as popen_spawn_posix

    class Popen(popen_spawn_posix.Popen):
        def _launch(self, process_obj):
            import io
            from multiprocessing import context, reduction, resource_tracker, spawn, util

            import torch

            if native_threads() > 1 or torch.cuda.is_initialized():
                return super()._launch(process_obj)  # a new interpreter: a fork would not be safe
            resource_tracker.getfd()  # started by the parent, as spawn does
            data = io.BytesIO()
            context.set_spawning_popen(self)
            try:  # what spawn sends its child, pickled here as spawn pickles it
                reduction.dump(spawn.get_preparation_data(process_obj._name), data)
                reduction.dump(process_obj, data)
            finally:
                context.set_spawning_popen(None)
            parent_r, child_w = os.pipe()  # the sentinel: readable once the child has ended
            child_r, parent_w = os.pipe()  # the child's: readable once this parent has ended
            self.pid = os.fork()
            if self.pid == 0:
                code = 1
                try:
                    os.close(parent_r)
                    os.close(parent_w)
                    code = become_spawned(data.getvalue(), child_r)
                finally:
                    import atexit

                    atexit._run_exitfuncs()
                    for stream in (sys.stdout, sys.stderr):
                        try:
                            stream.flush()
                        except (OSError, ValueError):
                            pass
                    os._exit(code)
            os.close(child_w)
            os.close(child_r)
            self.sentinel = parent_r
            self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))

    popen_spawn_posix.Popen = Popen


def become_spawned(data, parent_sentinel):
    """In a child forked by spawn_from_this_python(): what spawn's new interpreter does with the
    pickled preparation and process (multiprocessing.spawn._main), from a state like its own."""
    import io
    import types
    from multiprocessing import process, reduction, spawn

    import torch

    for signum in signal.valid_signals():  # as at start-up; an ignored signal stays ignored (exec)
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                signal.signal(signum, default)
        except (OSError, ValueError):
            pass
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # what Python ignores at start-up
        signal.signal(signum, signal.SIG_IGN)
    torch.random.set_rng_state(START["rng"])
    torch.set_num_threads(START["threads"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # from the OS's entropy, as in a new interpreter
    sys.modules["__main__"] = types.ModuleType("__main__")  # so that spawn imports the script again
    source = io.BytesIO(data)
    process.current_process()._inheriting = True
    try:
        spawn.prepare(reduction.pickle.load(source))
        obj = reduction.pickle.load(source)
    finally:
        del process.current_process()._inheriting
    return obj._bootstrap(parent_sentinel)


# --------------------------------------------------------------------------- torchrun's ranks
def ranks_from_a_zygote():
    """Before torchrun runs here: fork the zygote, and have torchrun's SubprocessHandler ask it for
    each rank instead of starting a new interpreter (see the docstring above)."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    status = tempfile.mkdtemp(prefix="course-zygote-")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent = os.getpid()
    if os.fork() == 0:
        ours.close()
        zygote(theirs, status, agent)  # returns only in a rank, which then runs its script
        return
    theirs.close()
    import atexit
    import shutil

    atexit.register(shutil.rmtree, status, ignore_errors=True)

    def _popen(self, args, env):
        argv = list(args)
        if argv[0] != sys.executable:  # another program (--no-python): as torchrun would
            return original(self, args, env)
        fds = [f.fileno() for f in (self._stdout, self._stderr) if f is not None]
        request = {"argv": argv[1:], "env": env, "cwd": os.getcwd(), "out": None, "err": None,
                   "stdio": len(fds) == 2}
        socket.send_fds(ours, [json.dumps(request).encode()], fds if len(fds) == 2 else [])
        pid = int(ours.recv(64))
        return Launched(pid, os.path.join(status, str(pid)))

    original = subprocess_handler.SubprocessHandler._popen
    subprocess_handler.SubprocessHandler._popen = _popen


def zygote(connection, status, agent):
    """Fork a rank for each request of the agent; die with the agent."""
    import ctypes

    global STATUS
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends when the agent does
    if os.getppid() != agent:
        os._exit(0)
    STATUS = status
    signal.signal(signal.SIGCHLD, reap)
    while True:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        if not message:  # the agent has closed its end: it has ended
            os._exit(0)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            connection.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if not request.pop("stdio"):
                request["out"] = request["err"] = None  # inherited: the agent's own output
            run(request, stdio=fds)
        for fd in fds:
            os.close(fd)
        connection.send(str(pid).encode())


START = {}  # torch's random state and thread count at start-up


def main(address, status):
    global STATUS
    STATUS = status
    import torch  # noqa: F401  (what every launch would import)
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it)
    import torch.distributed  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    START.update(rng=torch.random.get_rng_state(), threads=torch.get_num_threads())
    signal.signal(signal.SIGCHLD, reap)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen()
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        with connection, connection.makefile("rw") as stream:
            request = json.loads(stream.readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                connection.close()
                run(request)
            stream.write(f"{pid}\n")
            stream.flush()


# --------------------------------------------------------------------------- the client
class Launcher:
    """The server, started on first use and stopped at exit; popen() launches through it. With
    `existing` (the folder of a server already running, as COURSE_LAUNCHER gives it to the
    notebooks' kernels), that one is used, and left running."""

    def __init__(self, existing=None):
        self.server, self.existing = None, existing

    def ensure_started(self):
        """The folder of the running server (started now if need be), for COURSE_LAUNCHER."""
        if self.existing is None and (self.server is None or self.server.poll() is not None):
            self.start()
        return str(self.folder)

    def start(self):
        import atexit
        import subprocess
        import tempfile
        from pathlib import Path

        self.folder = Path(tempfile.mkdtemp(prefix="course-launcher-"))
        self.address = str(self.folder / "socket")
        (self.folder / "status").mkdir()
        self.server = subprocess.Popen([sys.executable, __file__, self.address, str(self.folder / "status")],
                                       stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self.server.stdout.readline().strip() == "ready", "notebooks/launcher.py did not start"
        atexit.register(self.stop)

    def stop(self):
        import shutil

        if self.server is not None:
            self.server.kill()
            self.server.wait()
            shutil.rmtree(self.folder, ignore_errors=True)
            self.server = None

    def popen(self, argv, env, cwd, merge=False):
        """Like subprocess.Popen([python, *argv], cwd=cwd, env=env), output in files: a Launched."""
        from pathlib import Path

        if self.existing is not None:
            self.folder, self.address = Path(self.existing), str(Path(self.existing) / "socket")
        elif self.server is None or self.server.poll() is not None:
            self.start()
        out = self.folder / f"{os.urandom(6).hex()}.out"
        err = out if merge else out.with_suffix(".err")
        out.touch()
        err.touch()
        request = {"argv": [str(a) for a in argv], "env": {k: str(v) for k, v in env.items()},
                   "cwd": str(cwd), "out": str(out), "err": str(err)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.address)
            s.sendall((json.dumps(request) + "\n").encode())
            pid = int(s.makefile().readline())
        return Launched(pid, self.folder / "status" / str(pid), out, err)


class Launched:
    """A launched child, as much of subprocess.Popen as the tests and course_helpers.run use:
    pid, returncode, poll(), wait(), send_signal(), kill(), and stdout, the lines of its output
    file as they come (until it has ended), when output and errors go to one file."""

    def __init__(self, pid, status, out=None, err=None):
        from pathlib import Path

        self.pid, self.status, self.out, self.err, self.returncode = pid, Path(status), out, err, None
        self.stdout = self.lines() if out is not None and out == err else None

    def poll(self):
        if self.returncode is None and self.status.exists():
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout=None):
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self):
        import signal

        try:
            os.killpg(self.pid, signal.SIGKILL)  # the child and what it started: its own session
        except ProcessLookupError:
            pass

    def lines(self):
        import time

        with open(self.out) as f:
            pending = ""
            while True:
                chunk = f.read()
                pending += chunk
                *complete, pending = pending.split("\n")
                yield from (line + "\n" for line in complete)
                if not chunk:
                    if self.poll() is not None:
                        rest = f.read()
                        if rest:
                            pending += rest
                            continue
                        if pending:
                            yield pending
                        return
                    time.sleep(0.05)

    def output(self):
        return self.out.read_text(), self.err.read_text()

    def communicate(self, timeout=None):
        """As Popen's with stdout=PIPE, stderr=STDOUT: (everything printed, None) once it has ended."""
        self.wait(timeout)
        return self.out.read_text(), None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()
        for path in {self.status, self.out, self.err}:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
