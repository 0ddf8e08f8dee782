"""Two machines on one computer: a network lab of two hosts, each a Linux network namespace with its
own address, hostname and /etc/hosts, joined by one link of a chosen bandwidth (root only).

Each host (default host0, host1) is a network namespace `<prefix>-<host>` whose interface eth0 is
one end of a veth pair (10.77.0.1/24 and 10.77.0.2/24); both ends live inside the namespaces, so
nothing is routed to or from the machine's own network. A command run in a host also gets its own
UTS namespace whose hostname is the host's name, and /etc/netns/<namespace>/hosts (which
`ip netns exec` mounts over /etc/hosts) makes both names resolve to the lab's addresses (and only
from that file: nsswitch.conf there says `hosts: files`, the lab has no DNS). The link's
bandwidth is a token bucket (tc tbf) on both ends, so both directions are capped; a full bucket lets
burst_bytes() through at the hosts' own speed first. There is no added latency. The file system is
shared: the repository and its .venv are the same in every host.

    python3 tools/lab/netlab.py up --rate 1gbit           # make the lab (removes a stale one first)
    python3 tools/lab/netlab.py run host0 -- hostname     # run a command in a host
    python3 tools/lab/netlab.py set-rate 100mbit          # change the bandwidth (none: uncapped)
    python3 tools/lab/netlab.py link host1 down           # cut host1 off (link host1 up: back)
    python3 tools/lab/netlab.py status
    python3 tools/lab/netlab.py down                      # remove everything the lab made

From Python (the lab is removed on leaving the block, also after an exception or Ctrl-C):

    with netlab.Lab(rate="1gbit") as lab:
        server = lab.popen("host1", ["python", "server.py"])
        lab.run("host0", ["python", "client.py", lab.address("host1")], check=True)

Needs root, iproute2 (ip, tc) and util-linux (unshare); standard library only.
"""
import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PREFIX = "ddplab"
DEFAULT_HOSTS = ("host0", "host1")
DEFAULT_SUBNET = "10.77.0.0/24"
IFNAME = "eth0"  # the lab interface's name in every host
NETNS_ETC = Path("/etc/netns")
NEEDS = "root, with iproute2 (ip, tc) and util-linux (unshare)"
# Rates as tc writes them, in bits per second (bps etc. are bytes per second, as in tc).
RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
              "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
PREFIX_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
HOST_NAME = re.compile(r"^[a-z][a-z0-9]*$")  # no '-': `<prefix>-<host>` names one lab's parts only
REPO = Path(__file__).resolve().parents[2]


class LabError(RuntimeError):
    """The lab cannot be made or used; the message is one line that says why and what is needed."""


def missing_requirements():
    """One line saying why the lab cannot be made here, or None when it can."""
    if sys.platform != "linux":
        return f"netlab: needs Linux network namespaces ({NEEDS})"
    if os.geteuid() != 0:
        return f"netlab: needs root to make network namespaces ({NEEDS})"
    absent = [tool for tool in ("ip", "tc", "unshare", "hostname") if shutil.which(tool) is None]
    if absent:
        return f"netlab: {', '.join(absent)} not found ({NEEDS}; Debian: apt-get install iproute2)"
    return None


def check_requirements():
    reason = missing_requirements()
    if reason:
        raise LabError(reason)


def burst_bytes(bits):
    """The token bucket's size on a link capped at `bits` per second: 4 ms at the rate, at least
    64 KB so that a full GSO packet fits. After a pause that refills it (burst / rate), this many
    bytes pass at the hosts' own speed before the cap binds."""
    return max(bits // 8 // 250, 65536)


def parse_rate(rate):
    """Bits per second for a tc-style rate ("100mbit", "1gbit", "10gbit"); None for none/uncapped."""
    if rate is None or str(rate).strip().lower() in ("", "none", "0", "uncapped", "off"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", str(rate).strip().lower())
    if not match or match.group(2) not in RATE_UNITS:
        raise LabError(f"netlab: rate {rate!r} not understood (e.g. 100mbit, 1gbit, 10gbit, none)")
    return int(float(match.group(1)) * RATE_UNITS[match.group(2)])


def format_rate(bits):
    if bits is None:
        return "none"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= RATE_UNITS[unit] and bits % RATE_UNITS[unit] == 0:
            return f"{bits // RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


def _sh(*argv, check=True, timeout=30):
    """Run a setup command (ip, tc); LabError with its message when it fails."""
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip().replace("\n", "; ")
        raise LabError(f"netlab: {' '.join(map(str, argv))} failed: {message}")
    return result


def ours(prefix, name):
    """Whether a namespace, link or folder name is `<prefix>-<host>` (a part of that lab)."""
    return re.fullmatch(re.escape(prefix) + r"-[a-z0-9]+", name) is not None


def namespaces(prefix):
    """The lab's network namespaces (those named `<prefix>-<host>`)."""
    result = _sh("ip", "netns", "list", check=False)
    return sorted(n for n in (line.split()[0] for line in result.stdout.splitlines() if line.strip())
                  if ours(prefix, n))


def root_links():
    """The names of the links in this (the root) network namespace."""
    lines = _sh("ip", "-o", "link", "show", check=False).stdout.splitlines()
    return [line.split(":")[1].strip().split("@")[0] for line in lines if line.count(":") >= 2]


def venv_bin():
    """The bin folder of the virtual environment that lab commands and jobs should find first on
    PATH: this Python's when it runs in one, else the repository's .venv/bin (None if absent)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    return REPO / ".venv" / "bin" if (REPO / ".venv" / "bin").is_dir() else None


def course_env(extra=None):
    """This process's environment with venv_bin() first on PATH, plus `extra`."""
    env = dict(os.environ)
    if venv_bin() is not None:
        env["PATH"] = os.pathsep.join([str(venv_bin()), env.get("PATH", "")])
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def netns_pids(namespace):
    result = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def kill_namespace_processes(namespace, grace=3.0):
    """SIGTERM every process in the network namespace, SIGKILL those left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = netns_pids(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while netns_pids(namespace) and time.monotonic() < deadline:
            time.sleep(0.05)


def remove(prefix=DEFAULT_PREFIX):
    """Remove every lab part named with the prefix: processes in its namespaces, the namespaces
    (and with them their veths), links left in this namespace and /etc/netns folders."""
    for namespace in namespaces(prefix):
        kill_namespace_processes(namespace)
        _sh("ip", "netns", "del", namespace, check=False)
    for name in root_links():  # a veth end left here (up makes none: both ends start in the hosts)
        if ours(prefix, name):
            _sh("ip", "link", "del", name, check=False)
    if NETNS_ETC.is_dir():
        for folder in NETNS_ETC.iterdir():
            if ours(prefix, folder.name):
                shutil.rmtree(folder, ignore_errors=True)
        try:
            NETNS_ETC.rmdir()  # only when empty
        except OSError:
            pass


def leftovers(prefix=DEFAULT_PREFIX):
    """What is left with this prefix: namespaces, links here, /etc/netns folders, live processes in
    the namespaces (an empty list once the lab is removed)."""
    found = [f"namespace {n}" for n in namespaces(prefix)]
    found += [f"process {pid} in {n}" for n in namespaces(prefix) for pid in netns_pids(n)]
    found += [f"link {name}" for name in root_links() if ours(prefix, name)]
    if NETNS_ETC.is_dir():
        found += [f"folder {p}" for p in NETNS_ETC.iterdir() if ours(prefix, p.name)]
    return found


# Sends or receives nbytes over TCP; the receiver prints the seconds from its first byte to the last.
TRANSFER = """
import socket, sys, time
role, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "receive":
    server = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = server.accept()
    got, start = 0, None
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        start = start or time.perf_counter()
        got += len(chunk)
    print(got, time.perf_counter() - start, flush=True)
    conn.sendall(b"k")
else:
    conn = socket.create_connection((host, port), timeout=10)
    conn.sendall(bytes(nbytes))
    conn.recv(1)
"""


class Lab:
    """Two hosts joined by one link: `with Lab(rate="1gbit") as lab: lab.run("host0", [...])`.

    up() makes it (removing a stale lab with the same prefix first), down() removes it and every
    process still running in it; as a context manager it is made on entry and removed on exit.
    """

    def __init__(self, prefix=DEFAULT_PREFIX, rate=None, hosts=DEFAULT_HOSTS, subnet=DEFAULT_SUBNET):
        if not PREFIX_NAME.match(prefix) or len(prefix) > 40:
            raise LabError(f"netlab: prefix {prefix!r} must be lower-case letters, digits and '-'")
        hosts = tuple(hosts)
        if len(hosts) != 2 or len(set(hosts)) != 2 or not all(HOST_NAME.match(h) for h in hosts):
            raise LabError(f"netlab: two distinct host names needed (lower-case letters and digits), "
                           f"got {hosts!r}")
        network = ipaddress.ip_network(subnet)
        self.prefix, self.hosts, self.rate = prefix, hosts, parse_rate(rate)
        self.prefixlen = network.prefixlen
        self.addresses = {h: str(network.network_address + 1 + i) for i, h in enumerate(hosts)}
        self._procs = []
        self._next_port = 29400

    @classmethod
    def existing(cls, prefix=DEFAULT_PREFIX):
        """The lab with this prefix that is up now (its hosts and addresses read from the system)."""
        check_requirements()
        found = namespaces(prefix)
        if len(found) != 2:
            raise LabError(f"netlab: no lab {prefix!r} is up (run: python3 tools/lab/netlab.py up)")
        hosts = [n[len(prefix) + 1:] for n in found]
        lab = cls(prefix, hosts=hosts)
        for host in hosts:
            out = _sh("ip", "-n", lab.namespace(host), "-4", "-o", "addr", "show", "dev", IFNAME,
                      check=False).stdout.split()
            if "inet" in out:
                address, lab.prefixlen = out[out.index("inet") + 1].split("/")
                lab.addresses[host], lab.prefixlen = address, int(lab.prefixlen)
        return lab

    def namespace(self, host):
        return f"{self.prefix}-{host}"

    def address(self, host):
        return self.addresses[host]

    def hosts_file(self):
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{self.addresses[h]}\t{h}" for h in self.hosts]
        return "\n".join(lines) + "\n"

    def up(self):
        """Make the lab; on any failure (or Ctrl-C) halfway, remove what was made and re-raise."""
        check_requirements()
        remove(self.prefix)
        try:
            for host in self.hosts:
                namespace = self.namespace(host)
                _sh("ip", "netns", "add", namespace)
                folder = NETNS_ETC / namespace
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(self.hosts_file())
                if Path("/etc/nsswitch.conf").exists():  # names from the hosts file only: no DNS here
                    (folder / "nsswitch.conf").write_text(re.sub(
                        r"(?m)^hosts:.*$", "hosts:          files", Path("/etc/nsswitch.conf").read_text()))
                _sh("ip", "-n", namespace, "link", "set", "lo", "up")
            first, second = (self.namespace(h) for h in self.hosts)
            _sh("ip", "link", "add", "name", IFNAME, "netns", first, "type", "veth",
                "peer", "name", IFNAME, "netns", second)
            for host in self.hosts:
                namespace = self.namespace(host)
                _sh("ip", "-n", namespace, "addr", "add", f"{self.addresses[host]}/{self.prefixlen}",
                    "dev", IFNAME)
                _sh("ip", "-n", namespace, "link", "set", IFNAME, "up")
            self.set_rate(format_rate(self.rate))
            self.wait_for_link()
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        """Remove the lab: its processes, namespaces, veths and /etc/netns folders."""
        remove(self.prefix)
        for proc in self._procs:  # reap what popen() started (killed above)
            if proc.poll() is None:  # started just before: not yet in its namespace when remove() looked
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    def set_rate(self, rate):
        """Cap the link at `rate` in both directions ("100mbit", "1gbit", ...; "none": uncapped)."""
        bits = parse_rate(rate)
        for host in self.hosts:
            namespace = self.namespace(host)
            _sh("tc", "-n", namespace, "qdisc", "del", "dev", IFNAME, "root", check=False)
            if bits is not None:
                _sh("tc", "-n", namespace, "qdisc", "add", "dev", IFNAME, "root", "tbf",
                    "rate", f"{bits}bit", "burst", burst_bytes(bits), "latency", "100ms")
        self.rate = bits

    def check_host(self, host):
        """LabError unless host is one of the lab's hosts."""
        if host not in self.hosts:
            raise LabError(f"netlab: no host {host!r} in lab {self.prefix!r} "
                           f"(hosts: {', '.join(self.hosts)})")

    def link(self, host, state, forget_neighbours=True):
        """Take a host's end of the link "down" (the host is cut off, as when its cable, switch or
        power goes: no connection is closed, its packets just stop) or bring it back "up".

        Up, it returns once both hosts can talk at once. The link's state is not enough for that:
        traffic sent to a host while it was cut off leaves the sender's neighbour (ARP) entry for it
        unresolved (INCOMPLETE), and a packet queued on that entry when its last probe goes
        unanswered fails with EHOSTUNREACH, "No route to host", link up or not; the next packet
        resolves it again. So `up` flushes both hosts' neighbour tables (forget_neighbours). A real
        network does not: forget_neighbours=False leaves them as the cut left them, to see what a
        machine meets for a few seconds after a real network blip."""
        self.check_host(host)
        if state not in ("up", "down"):
            raise LabError(f"netlab: link state {state!r}: say up or down")
        _sh("ip", "-n", self.namespace(host), "link", "set", IFNAME, state)
        if state == "up":
            self.wait_for_link()
            if forget_neighbours:
                self.forget_neighbours()

    def neighbours(self, host):
        """The host's neighbour (ARP) entries on the lab's link: {address: state}, e.g.
        {"10.77.0.2": "REACHABLE"}; "INCOMPLETE" while an address is being resolved, "FAILED" when
        its probes went unanswered."""
        self.check_host(host)
        out = _sh("ip", "-n", self.namespace(host), "neigh", "show", "dev", IFNAME).stdout
        return {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip()}

    def forget_neighbours(self):
        """Flush both hosts' neighbour tables: each resolves the other afresh at its next packet."""
        for h in self.hosts:
            _sh("ip", "-n", self.namespace(h), "neigh", "flush", "dev", IFNAME)

    def wait_for_link(self, seconds=10.0):
        """Return once both ends of the link are operationally up: a veth's peer sees its carrier come
        back a moment after `link set up`, and what is sent before then finds no route."""
        deadline = time.monotonic() + seconds
        while not all("state UP" in _sh("ip", "-n", self.namespace(h), "-o", "link", "show", IFNAME).stdout
                      for h in self.hosts):
            if time.monotonic() > deadline:
                raise LabError(f"netlab: the link is not up on both hosts after {seconds:g} s")
            time.sleep(0.05)

    def port(self):
        """A port for the next job's rendezvous in the lab. The hosts have a port space of their own,
        used by nothing but what runs in the lab (a free port of this machine's says nothing about
        it); each call gives a new one, clear of an earlier job's sockets still closing."""
        self._next_port += 1
        return self._next_port

    def current_rate(self, host=None):
        """The rate tc reports on a host's end of the link (e.g. '100Mbit'), or 'none'."""
        out = _sh("tc", "-n", self.namespace(host or self.hosts[0]), "qdisc", "show", "dev", IFNAME,
                  check=False).stdout
        match = re.search(r"\btbf\b.*?\brate (\S+)", out)
        return match.group(1) if match else "none"

    def is_up(self):
        return namespaces(self.prefix) == sorted(self.namespace(h) for h in self.hosts)

    def command(self, host, argv):
        """The command line that runs argv (a list, or a string for sh -c) in the host: in its network
        namespace and a new UTS namespace whose hostname is the host's name."""
        self.check_host(host)
        if isinstance(argv, (str, bytes)):
            argv = ["sh", "-c", argv]
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', host] + [str(a) for a in argv]

    def run(self, host, argv, *, timeout=60, check=False, capture_output=True, text=True, **kwargs):
        """subprocess.run of argv in the host (output captured as text unless told otherwise)."""
        return subprocess.run(self.command(host, argv), timeout=timeout, check=check,
                              capture_output=capture_output, text=text, **kwargs)

    def popen(self, host, argv, **kwargs):
        """subprocess.Popen of argv in the host, for long commands (a server, torchrun); its pid is
        the command's own. down() kills it if it is still running."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def transfer(self, sender, receiver, nbytes, *, to=None, port=5201, timeout=60):
        """Send nbytes over TCP from one host to the other (to `to`: the receiver's name unless given,
        e.g. its address); the seconds the receiver took from the first byte to the last."""
        python = sys.executable
        server = self.popen(receiver, [python, "-c", TRANSFER, "receive", "-", port, nbytes],
                            stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise LabError(f"netlab: the receiver in {receiver} did not start")
            sent = self.run(sender, [python, "-c", TRANSFER, "send", to or receiver, port, nbytes],
                            timeout=timeout)
            if sent.returncode != 0:
                reason = (sent.stderr.strip().splitlines() or ["no message"])[-1]
                raise LabError(f"netlab: {sender} could not send to {to or receiver}: {reason}")
            out, _ = server.communicate(timeout=timeout)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        got, seconds = out.split()
        if int(got) != nbytes:
            raise LabError(f"netlab: {receiver} received {got} of {nbytes} bytes")
        return float(seconds)

    def status(self):
        """{host: {namespace, address, rate, pids}} for the hosts that exist now."""
        present = set(namespaces(self.prefix))
        return {h: {"namespace": self.namespace(h), "address": self.addresses[h],
                    "rate": self.current_rate(h), "pids": netns_pids(self.namespace(h))}
                for h in self.hosts if self.namespace(h) in present}

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    prefix = argparse.ArgumentParser(add_help=False)
    prefix.add_argument("--prefix", default=argparse.SUPPRESS,
                        help=f"the lab's name, the prefix of all it makes (default {DEFAULT_PREFIX})")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="action", required=True)
    up = commands.add_parser("up", parents=[prefix], help="make the lab (a stale one is removed first)")
    up.add_argument("--rate", default="none", help="link bandwidth: 100mbit, 1gbit, 10gbit, none")
    up.add_argument("--hosts", default=",".join(DEFAULT_HOSTS), help="the two host names (host0,host1)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"the lab's addresses ({DEFAULT_SUBNET})")
    commands.add_parser("down", parents=[prefix], help="remove the lab and its processes")
    commands.add_parser("status", parents=[prefix], help="the hosts, addresses, rate and processes")
    set_rate = commands.add_parser("set-rate", parents=[prefix], help="change the link's bandwidth")
    set_rate.add_argument("rate")
    link = commands.add_parser("link", parents=[prefix],
                               help="cut a host off (link HOST down) or bring it back (link HOST up)")
    link.add_argument("host")
    link.add_argument("state", choices=("up", "down"))
    link.add_argument("--keep-neighbours", action="store_true",
                      help="up: keep the neighbour (ARP) entries the cut left, as a real network does")
    run = commands.add_parser("run", parents=[prefix], help="run a command in a host: run HOST -- CMD ...")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        reason = missing_requirements()
        if reason:
            raise LabError(reason)
        if args.action == "up":
            lab = Lab(args.prefix, rate=args.rate, hosts=args.hosts.split(","), subnet=args.subnet).up()
            print(f"lab {lab.prefix} up: " + ", ".join(f"{h} {lab.address(h)}" for h in lab.hosts)
                  + f", rate {format_rate(lab.rate)}")
        elif args.action == "down":
            remove(args.prefix)
            print(f"lab {args.prefix} removed")
        elif args.action == "status":
            if not namespaces(args.prefix):
                print(f"lab {args.prefix}: not up")
                return 1
            for host, info in Lab.existing(args.prefix).status().items():
                print(f"{host}: namespace {info['namespace']}, {IFNAME} {info['address']}, "
                      f"rate {info['rate']}, {len(info['pids'])} processes")
        elif args.action == "set-rate":
            lab = Lab.existing(args.prefix)
            lab.set_rate(args.rate)
            print(f"lab {lab.prefix}: rate {lab.current_rate()}")
        elif args.action == "link":
            Lab.existing(args.prefix).link(args.host, args.state, forget_neighbours=not args.keep_neighbours)
            print(f"lab {args.prefix}: {args.host}'s link {args.state}")
        elif args.action == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("run: no command (run HOST -- COMMAND ...)")
            lab = Lab.existing(args.prefix)
            return subprocess.run(lab.command(args.host, cmd)).returncode
    except LabError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
