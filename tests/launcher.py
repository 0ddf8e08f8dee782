"""A Python with torch already imported, from which the tests' launches are forked.

A script launched by a test pays about 2-3 s before its first line runs: the interpreter, `import
torch`, and (for a DDP launcher) `torch._dynamo`. The suite launches scripts a few hundred times.
This server imports them once; each launch is a child forked from it, which then runs the script
exactly as `python script.py args...` would (`runpy`, `__main__`, `sys.argv`, the environment, the
working folder, its own session, standard input from /dev/null, output to files) and exits through
the interpreter's usual exit. What differs from a fresh interpreter: the modules imported here are
already imported, and the child starts with one thread. Tests about start-up itself, or that need
a fresh interpreter, launch with `fresh=True` (helpers.run_script).

Protocol, over a Unix socket: a request is one JSON line {"argv", "env", "cwd", "out", "err"}; the
answer is the child's pid. When a child ends, the server writes its exit code (negative: the signal
that ended it) to `<status folder>/<pid>`.

    python tests/launcher.py SOCKET STATUS_FOLDER
"""
import json
import os
import runpy
import signal
import socket
import sys


def reap(signum, frame):
    """SIGCHLD: record the exit code of every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = os.path.join(STATUS, str(pid))
        with open(path + ".part", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + ".part", path)


def run(request):
    """In the forked child: become `python <argv>`, run it, exit as it would."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_APPEND),
                           (2, request["err"], os.O_WRONLY | os.O_APPEND)):  # out and err may be one file
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import multiprocessing.process  # where a spawned child resolves a relative script path from

    multiprocessing.process.ORIGINAL_DIR = os.path.abspath(request["cwd"])
    argv = request["argv"]
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


def main(address, status):
    global STATUS
    STATUS = status
    import torch  # noqa: F401  (what every launch would import)
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it)
    import torch.distributed  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import torch.nn.parallel  # noqa: F401

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
        assert self.server.stdout.readline().strip() == "ready", "tests/launcher.py did not start"
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

    def __init__(self, pid, status, out, err):
        self.pid, self.status, self.out, self.err, self.returncode = pid, status, out, err, None
        self.stdout = self.lines() if out == err else None

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
