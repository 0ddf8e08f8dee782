"""A Slurm cluster on one computer, from Debian's slurm-wlm: two nodes, one in each host of a
netlab lab (tools/lab/netlab.py), or one node on this machine's loopback (--local) (root only).

Each node is a slurmd in its lab host, with that host's name and address (`slurmd -N host0`,
NodeAddr 10.77.0.1); slurmctld runs in the first host, and sbatch, srun, squeue and scontrol run
there too, with SLURM_CONF pointing at the slurm.conf this tool writes into a temporary folder
(state, spool, logs and pid files there as well). No munge (auth/none, cred/none), no cgroups
(proctrack/linuxproc); task/affinity pins each task to its CPUs. Every node declares CPUs=2: on a
two-core machine both nodes share the same two cores, which is fine for correctness, not speed.
slurm-wlm is installed with apt-get when it is absent and this runs as root.

    python3 tools/lab/slurm_lab.py up                          # lab + cluster (a stale one is removed)
    python3 tools/lab/slurm_lab.py run -- sinfo -N
    python3 tools/lab/slurm_lab.py run -- sbatch --wait --cpus-per-task 2 launch/slurm_ddp.sbatch
    python3 tools/lab/slurm_lab.py status
    python3 tools/lab/slurm_lab.py down                        # stop the daemons, remove lab and folder

From Python (stopped and removed on leaving the blocks, also after an exception or Ctrl-C):

    with netlab.Lab(prefix="ddpslurm") as lab, slurm_lab.Cluster(lab) as cluster:
        job = cluster.sbatch("job.sh", options=["--nodes", "2"], timeout=120)
        print(job.state, job.exit_code, job.output)
"""
import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab  # noqa: E402

DEFAULT_PREFIX = netlab.DEFAULT_PREFIX
SBIN = ("/usr/sbin", "/sbin", "/usr/bin")
DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}
NEEDS = "root and Debian's slurm-wlm (apt-get install slurm-wlm)"


class SlurmError(RuntimeError):
    """The cluster cannot be made or used; the message is one line that says why."""


def which(name):
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def slurm_version():
    """Slurm's version as a tuple, e.g. (22, 5, 8), from `slurmd -V`; None when it is absent."""
    slurmd = which("slurmd")
    if slurmd is None:
        return None
    out = subprocess.run([slurmd, "-V"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def install_slurm(log=sys.stderr):
    """apt-get install -y slurm-wlm (apt-get update first only if the install fails); True if done."""
    if os.geteuid() != 0 or which("apt-get") is None:
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm"]
    print("slurm_lab: installing slurm-wlm with apt-get (about 20 s) ...", file=log)
    for step in ([install], [["apt-get", "update", "-q"], install]):
        try:
            if all(subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode == 0
                   for cmd in step):
                return True
        except subprocess.TimeoutExpired:
            return False
    return False


def plugin_dir():
    found = glob.glob("/usr/lib/*/slurm-wlm/auth_none.so") + glob.glob("/usr/lib*/slurm/auth_none.so")
    return str(Path(found[0]).parent) if found else None


def missing_requirements(install=True):
    """One line saying why the cluster cannot run here, or None when it can. Installs slurm-wlm
    (as root, with apt-get) when it is absent and `install` is true."""
    if sys.platform != "linux":
        return f"slurm_lab: needs Linux ({NEEDS})"
    if os.geteuid() != 0:
        return f"slurm_lab: needs root to run slurmctld and slurmd ({NEEDS})"
    absent = [t for t in DAEMONS + CLIENTS if which(t) is None]
    if absent and install and install_slurm():
        absent = [t for t in DAEMONS + CLIENTS if which(t) is None]
    if absent:
        return f"slurm_lab: {', '.join(absent)} not found and not installable ({NEEDS})"
    if plugin_dir() is None:
        version = ".".join(map(str, slurm_version() or ())) or "unknown"
        return (f"slurm_lab: this Slurm ({version}) has no auth/none plugin "
                f"(Slurm <= 23.02 needed, e.g. Debian 12)")
    return None


def free_ports(n):
    """n distinct TCP ports free on this machine now, for a cluster without a lab (the daemons share
    this machine's ports), drawn as the scripts draw theirs: below the OS's ephemeral range, so that
    no connection takes one before a daemon binds it. Needs the course's Python (torch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ddp_scripts"))
    from ddp_hardening import free_port

    ports = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return tuple(ports)


def slurm_conf(workdir, nodes, controller, *, ports, cpus=2, cluster_name="ddplab"):
    """slurm.conf for nodes [(name, address)], slurmctld at controller (name, address)."""
    w = Path(workdir)
    lines = [
        f"ClusterName={cluster_name}",
        f"SlurmctldHost={controller[0]}({controller[1]})",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",                 # no munge: the cluster lives on one machine
        "CredType=cred/none",
        f"StateSaveLocation={w}/state",
        f"SlurmdSpoolDir={w}/spool-%n",       # %n: the node's name, one folder per slurmd
        f"SlurmctldPidFile={w}/slurmctld.pid",
        f"SlurmdPidFile={w}/slurmd-%n.pid",
        f"SlurmctldLogFile={w}/slurmctld.log",
        f"SlurmdLogFile={w}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={w}/plugstack.conf",  # empty: no SPANK plugins from /etc/slurm
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "TaskPlugin=task/affinity",           # pins each task to its CPUs (sched_getaffinity shows it)
        # A step that asks for fewer CPUs than the node's share of the job gets one CPU per task
        # (as on clusters that bind tasks to cores), not every CPU of the allocation.
        "TaskPluginParam=autobind=threads",
        "ProctrackType=proctrack/linuxproc",  # no cgroups needed
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SlurmdParameters=config_overrides",  # the CPUs declared here, whatever the machine has
        "ReturnToService=2",
        "SlurmctldTimeout=10",
        "SlurmdTimeout=10",
        "MessageTimeout=5",
        "BatchStartTimeout=10",
        "InactiveLimit=0",
        "KillWait=2",
        # Finished jobs are never purged (the cluster lives for one lesson or test), and so `sbatch
        # --wait` asks every 2 s whether its job has ended: it waits 4x longer after each ask, up to
        # 32 s, only while that is under MinJobAge / 2 (a 10 s job reported after 42 s with 300).
        "MinJobAge=0",
    ]
    lines += [f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN" for name, address in nodes]
    lines.append(f"PartitionName=lab Nodes={','.join(n for n, _ in nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


# slurmd always loads a cgroup plugin; autodetect fails where /sys/fs/cgroup is not mounted (as in
# `ip netns exec`'s own /sys), cgroup/v1 loads without it, and nothing here uses cgroups.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"


def parse_record(text):
    """scontrol's one-line `Key=Value Key=Value` record as a dict (values may hold spaces)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(?:^|\s)([A-Za-z:/]+)=(.*?)(?=\s+[A-Za-z:/]+=|$)",
                                                         text.strip())}


@dataclasses.dataclass
class Job:
    """A finished batch job: its state (COMPLETED, FAILED, ...), exit code and signal (from
    ExitCode=code:signal), the text of its output file, and scontrol's record of it."""
    job_id: int
    state: str
    exit_code: int
    signal: int
    output: str
    stdout_path: str
    record: dict

    @property
    def ok(self):
        return self.state == "COMPLETED" and self.exit_code == 0


def _kill_pidfile(pidfile, workdir):
    """Stop the daemon whose pid is in pidfile, if its command line names workdir (a stale run's)."""
    try:
        pid = int(Path(pidfile).read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return
    if str(workdir) in cmdline:
        _terminate([pid])


def alive(pid):
    """Whether the process runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _terminate(pids, grace=5.0):
    """SIGTERM, then SIGKILL after `grace` seconds, the pids still alive."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [p for p in pids if alive(p)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def remove_stale(prefix=DEFAULT_PREFIX, keep=None):
    """Stop the daemons of clusters with this prefix left behind by a killed run, remove their folders."""
    tmp = tempfile.gettempdir()
    folders = [*glob.glob(os.path.join(tmp, f"{prefix}-slurm-*")),
               *glob.glob(os.path.join(tmp, f"{prefix}-slurm"))]
    for folder in folders:
        if keep is not None and Path(folder) == Path(keep):
            continue
        for pidfile in glob.glob(os.path.join(folder, "*.pid")):
            _kill_pidfile(pidfile, folder)
        shutil.rmtree(folder, ignore_errors=True)


class Cluster:
    """A Slurm cluster: `with Cluster(lab) as cluster: job = cluster.sbatch("job.sh")`.

    With `lab` (a netlab.Lab that is up): one node per lab host, slurmctld and the commands in the
    first host. Without: one node, "localhost" on 127.0.0.1, in this machine's own network.
    `workdir` holds slurm.conf, state, spool, logs and pid files (default: a new temporary folder);
    down() stops the daemons and removes it.
    """

    def __init__(self, lab=None, *, prefix=None, workdir=None, cpus=2, start_timeout=60):
        self.lab, self.cpus, self.start_timeout = lab, cpus, start_timeout
        self.prefix = prefix or (lab.prefix if lab else DEFAULT_PREFIX)
        self._workdir_given = workdir is not None
        self.workdir = Path(workdir) if workdir else None
        if lab:
            self.nodes = [(h, lab.address(h)) for h in lab.hosts]
        else:
            self.nodes = [("localhost", "127.0.0.1")]
        self.submit_host = lab.hosts[0] if lab else None
        self._daemons = {}

    @property
    def conf(self):
        return self.workdir / "slurm.conf"

    @property
    def daemon_pids(self):
        """{"slurmctld": pid, "slurmd-host0": pid, ...} of the daemons this object started."""
        return {name: proc.pid for name, proc in self._daemons.items()}

    @property
    def node_names(self):
        return [n for n, _ in self.nodes]

    def env(self, extra=None):
        """This process's environment with SLURM_CONF set and the course's .venv/bin first on PATH
        (netlab.course_env): what sbatch passes on to the job (--export=ALL)."""
        env = netlab.course_env({"SLURM_CONF": self.conf})
        env["PATH"] = os.pathsep.join([env["PATH"], *SBIN])
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def command(self, argv, host=None):
        """argv as run on `host` (default: the submit host, where slurmctld runs)."""
        host = host or self.submit_host
        return self.lab.command(host, argv) if self.lab else [str(a) for a in argv]

    def run(self, argv, *, host=None, timeout=60, check=False, env=None, **kwargs):
        """subprocess.run of a Slurm command (sbatch, srun, squeue ...) with SLURM_CONF set."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        result = subprocess.run(self.command(argv, host), timeout=timeout, env=self.env(env), **kwargs)
        if check and result.returncode != 0:
            raise SlurmError(f"slurm_lab: {' '.join(map(str, argv))} failed ({result.returncode}): "
                             f"{(result.stderr or '').strip()[-500:]}")
        return result

    def popen(self, argv, *, host=None, env=None, **kwargs):
        """subprocess.Popen of a command (e.g. srun ... torchrun) with SLURM_CONF set, in the
        background; the caller waits for it (or down() of the lab kills it)."""
        if self.lab:
            return self.lab.popen(host or self.submit_host, argv, env=self.env(env), **kwargs)
        return subprocess.Popen([str(a) for a in argv], env=self.env(env), **kwargs)

    def _start(self, name, argv, host):
        log = open(self.workdir / f"{name}.out", "wb")
        try:
            argv = [which(argv[0])] + argv[1:]
            if self.lab:
                proc = self.lab.popen(host, argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            else:
                proc = subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._daemons[name] = proc

    def _log_tail(self, name):
        parts = []
        for path in (self.workdir / f"{name}.log", self.workdir / f"{name}.out"):
            with contextlib.suppress(OSError):
                parts += [ln for ln in path.read_text(errors="replace").splitlines()
                          if "error" in ln and "pmix" not in ln.lower()]  # pmix: absent, unused
        return "; ".join(parts[-3:]) or "no log"

    def up(self):
        """Write the configuration, start slurmctld and the slurmds, wait until every node is idle.
        On a failure (or Ctrl-C) halfway, stop what was started and re-raise."""
        reason = missing_requirements()
        if reason:
            raise SlurmError(reason)
        if self.lab and not self.lab.is_up():
            raise SlurmError(f"slurm_lab: lab {self.lab.prefix!r} is not up")
        remove_stale(self.prefix, keep=self.workdir if self._workdir_given else None)
        try:
            if self.workdir is None:
                self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-slurm-"))
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir.mkdir(parents=True)
            (self.workdir / "state").mkdir()
            for name in self.node_names:
                (self.workdir / f"spool-{name}").mkdir()
            ports = free_ports(2) if not self.lab else (6817, 6818)  # a lab host's ports are its own
            self.conf.write_text(slurm_conf(self.workdir, self.nodes, self.nodes[0], ports=ports,
                                            cpus=self.cpus, cluster_name=self.prefix.replace("-", "")))
            (self.workdir / "cgroup.conf").write_text(CGROUP_CONF)
            (self.workdir / "plugstack.conf").write_text("")
            (self.workdir / "cluster.json").write_text(json.dumps(
                {"prefix": self.prefix, "lab": self.lab.prefix if self.lab else None,
                 "nodes": self.nodes, "submit_host": self.submit_host}))
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], self.submit_host)
            for name, _ in self.nodes:
                self._start(f"slurmd-{name}", ["slurmd", "-D", "-f", str(self.conf), "-N", name],
                            name if self.lab else None)
            self.wait_idle(self.start_timeout)
        except BaseException:
            self.down()
            raise
        return self

    def wait_idle(self, timeout=60):
        """Wait until every node is idle (registered); SlurmError when a daemon exits or time is up."""
        deadline = time.monotonic() + timeout
        states = {}
        while time.monotonic() < deadline:
            for name, proc in self._daemons.items():
                if proc.poll() is not None:
                    raise SlurmError(f"slurm_lab: {name} exited ({proc.returncode}): {self._log_tail(name)}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
            states = dict(line.split()[:2] for line in result.stdout.splitlines() if len(line.split()) >= 2)
            if states and all(states.get(n) == "idle" for n in self.node_names):
                return states
            time.sleep(0.3)
        raise SlurmError(f"slurm_lab: nodes not idle after {timeout} s: "
                         f"{states or 'no answer from slurmctld'}")

    def _controller_alive(self):
        if "slurmctld" in self._daemons:
            return self._daemons["slurmctld"].poll() is None
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.workdir / "slurmctld.pid").read_text().split()[0])
            return str(self.workdir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        return False

    def down(self):
        """Cancel the jobs, stop the daemons, remove the folder (the lab itself stays)."""
        if self.workdir is None:
            return
        if self._controller_alive():
            with contextlib.suppress(Exception):
                jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
                if jobs:
                    self.run(["scancel", *jobs], timeout=10)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and self.run(
                            ["squeue", "-h", "-o", "%A"], timeout=10).stdout.split():
                        time.sleep(0.3)
        _terminate([p.pid for p in self._daemons.values()])
        for proc in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
        self._daemons.clear()
        for pidfile in glob.glob(str(self.workdir / "*.pid")):  # daemons this object did not start
            _kill_pidfile(pidfile, self.workdir)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if not self._workdir_given:
            self.workdir = None

    def submit(self, script, *args, options=(), cwd=None, env=None):
        """sbatch a script (path) with options and script arguments; the job's id. The job runs in
        `cwd` (default: the cluster's folder, where slurm-<id>.out then goes too)."""
        result = self.run(["sbatch", "--parsable", *options, str(script), *args], cwd=cwd or self.workdir,
                          env=env, timeout=60, check=True)
        return int(result.stdout.strip().split(";")[0])

    def job_record(self, job_id):
        result = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=15)
        return parse_record(result.stdout) if result.returncode == 0 else {}

    def wait(self, job_id, timeout=120, poll=0.25):
        """Wait for a job to end (at most `timeout` s, then it is cancelled and SlurmError raised)."""
        deadline = time.monotonic() + timeout
        record = {}
        while time.monotonic() < deadline:
            record = self.job_record(job_id)
            if record.get("JobState") in DONE_STATES:
                break
            time.sleep(poll)
        else:
            self.run(["scancel", str(job_id)], timeout=15)
            raise SlurmError(f"slurm_lab: job {job_id} still {record.get('JobState', 'unknown')} "
                             f"after {timeout} s (cancelled)")
        code, _, sig = record.get("ExitCode", "0:0").partition(":")
        path = record.get("StdOut", "")
        output = ""
        with contextlib.suppress(OSError):
            output = Path(path).read_text(errors="replace")
        return Job(job_id, record["JobState"], int(code), int(sig or 0), output, path, record)

    def sbatch(self, script, *args, options=(), cwd=None, env=None, timeout=120):
        """Submit a batch script and wait for it: a Job (state, exit code, output)."""
        return self.wait(self.submit(script, *args, options=options, cwd=cwd, env=env), timeout=timeout)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False


def cli_workdir(prefix):
    return Path(tempfile.gettempdir()) / f"{prefix}-slurm"


def existing(prefix=DEFAULT_PREFIX):
    """The cluster that `slurm_lab.py up` left running (read from its folder)."""
    workdir = cli_workdir(prefix)
    try:
        info = json.loads((workdir / "cluster.json").read_text())
    except (OSError, ValueError):
        raise SlurmError(f"slurm_lab: no cluster {prefix!r} is up (run: python3 tools/lab/slurm_lab.py up)")
    lab = netlab.Lab.existing(info["lab"]) if info["lab"] else None
    return Cluster(lab, prefix=prefix, workdir=workdir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help=f"names the lab and the cluster's folder (default {DEFAULT_PREFIX})")
    commands = parser.add_subparsers(dest="action", required=True)
    up = commands.add_parser("up", help="start the cluster (a stale one with the prefix is removed)")
    up.add_argument("--local", action="store_true", help="one node on this machine's loopback, no lab")
    up.add_argument("--rate", default="none", help="the lab link's bandwidth (netlab up --rate)")
    commands.add_parser("down", help="stop the daemons, remove the folder and the lab")
    commands.add_parser("status", help="sinfo and squeue")
    run = commands.add_parser("run", help="run a command where slurmctld runs, SLURM_CONF set: run -- CMD")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            reason = missing_requirements() or (None if args.local else netlab.missing_requirements())
            if reason:
                raise SlurmError(reason)
            lab = None if args.local else netlab.Lab(args.prefix, rate=args.rate).up()
            try:
                cluster = Cluster(lab, prefix=args.prefix, workdir=cli_workdir(args.prefix)).up()
            except BaseException:
                if lab:
                    lab.down()
                raise
            print(f"cluster {args.prefix} up: nodes {', '.join(cluster.node_names)}; "
                  f"SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            if os.geteuid() != 0:
                raise SlurmError(f"slurm_lab: needs root ({NEEDS})")
            with contextlib.suppress(SlurmError, netlab.LabError):
                existing(args.prefix).down()
            remove_stale(args.prefix)
            if netlab.missing_requirements() is None:
                netlab.remove(args.prefix)
            print(f"cluster {args.prefix} removed")
        elif args.action == "status":
            cluster = existing(args.prefix)
            for cmd in (["sinfo", "-N"], ["squeue"]):
                print(cluster.run(cmd, timeout=30).stdout, end="")
        elif args.action == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("run: no command (run -- COMMAND ...)")
            return existing(args.prefix).run(cmd, timeout=None, capture_output=False, text=False).returncode
    except (SlurmError, netlab.LabError) as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
