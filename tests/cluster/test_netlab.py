"""tools/netlab.py: two hosts on one machine, each with its own network, address and hostname, joined
by one link of a set bandwidth, and nothing left behind (root only: skipped otherwise)."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402

PREFIX = "ddptest-net"  # not the default: a lab someone brought up by hand stays up
# In a host: connect to an address outside the lab; waits 3 s for a connection from anywhere.
OUTWARD = """
import errno, socket
try:
    socket.create_connection(("192.0.2.1", 80), timeout=2)
    print("connected")
except OSError as error:
    print("unreachable" if error.errno == errno.ENETUNREACH else error)
"""
LISTEN = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(3)
print("ready", flush=True)
try:
    server.accept()
    print("accepted")
except TimeoutError:
    print("none")
"""
IDENTITY = ("import socket; name = socket.gethostname(); "
            "print(name, socket.getfqdn(), socket.gethostbyname(name), socket.gethostbyname('{other}'))")


@pytest.fixture(scope="module")
def lab():
    reason = netlab.missing_requirements()
    if reason:
        pytest.skip(reason)
    with netlab.Lab(prefix=PREFIX) as lab:
        yield lab


@pytest.mark.timeout(10)
def test_netlab_rates_read_as_tc_reads_them():
    assert netlab.parse_rate("100mbit") == 100 * 10**6
    assert netlab.parse_rate("1gbit") == netlab.parse_rate("1000Mbit") == 10**9
    assert netlab.parse_rate("10mbps") == 80 * 10**6  # bytes per second, as in tc
    assert netlab.parse_rate("none") is None
    assert netlab.format_rate(10**10) == "10gbit"
    with pytest.raises(netlab.LabError):
        netlab.parse_rate("fast")


@pytest.mark.timeout(30)
def test_netlab_without_root_says_what_is_needed(capsys):
    """One line on stderr naming what is needed, and a non-zero exit (as root: run as nobody)."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) not found: cannot drop root to try")
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 sys.executable, str(REPO / "tools" / "netlab.py"), "up"],
                                capture_output=True, text=True, timeout=20, cwd="/")
        code, stderr = result.returncode, result.stderr
    else:
        code, stderr = netlab.main(["up"]), capsys.readouterr().err
    assert code != 0
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "root" in stderr and "iproute2" in stderr


@pytest.mark.timeout(60)
def test_netlab_up_removes_a_stale_lab_and_down_leaves_nothing():
    reason = netlab.missing_requirements()
    if reason:
        pytest.skip(reason)
    prefix = "ddptest-stale"
    netlab.remove(prefix)
    links_before = sorted(netlab.root_links())
    # What a killed run leaves: a namespace with a process in it, its hosts file, a veth here.
    subprocess.run(["ip", "netns", "add", f"{prefix}-host0"], check=True)
    (netlab.NETNS_ETC / f"{prefix}-host0").mkdir(parents=True, exist_ok=True)
    (netlab.NETNS_ETC / f"{prefix}-host0" / "hosts").write_text("10.77.0.1 host0\n")
    subprocess.run(["ip", "link", "add", f"{prefix}-a", "type", "veth", "peer", "name", f"{prefix}-b"],
                   check=True)
    stale = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-host0", "sleep", "60"])
    try:
        lab = netlab.Lab(prefix=prefix, rate="1gbit")
        try:
            lab.up()
            assert stale.wait(timeout=10) is not None
            assert not [p for p in netlab.leftovers(prefix) if "link" in p], netlab.leftovers(prefix)
            assert lab.is_up() and lab.current_rate() == "1Gbit"
            assert lab.run("host1", ["true"]).returncode == 0
            running = lab.popen("host0", ["sleep", "60"])
        finally:
            lab.down()
        assert running.poll() is not None  # killed with the lab
        assert netlab.leftovers(prefix) == []
        assert sorted(netlab.root_links()) == links_before  # no veth left here either
    finally:
        if stale.poll() is None:
            stale.kill()
        stale.wait()
        netlab.remove(prefix)


@pytest.mark.timeout(60)
def test_netlab_hosts_have_their_own_names_and_reach_each_other(lab):
    for host, other in (("host0", "host1"), ("host1", "host0")):
        result = lab.run(host, [sys.executable, "-c", IDENTITY.format(other=other)], check=True)
        # c10d's rendezvous hands every rank rank 0's getfqdn(): it must be the host's name here
        assert result.stdout.split() == [host, host, lab.address(host), lab.address(other)]
    assert lab.run("host0", ["hostname"]).stdout.strip() == "host0"
    assert socket.gethostname() not in ("host0", "host1")  # this machine's own name is unchanged
    lab.set_rate("none")
    assert lab.transfer("host0", "host1", 10_000) >= 0  # by name
    assert lab.transfer("host1", "host0", 10_000, to=lab.address("host0")) >= 0  # by address


@pytest.mark.timeout(60)
def test_netlab_is_not_routed_to_or_from_this_machine(lab):
    """No default route in a host, and nothing from this machine's network arrives in one (a
    connect() from here may still seem to succeed: the machine's own gateway may answer it)."""
    assert not [line for line in lab.run("host0", ["ip", "route"]).stdout.splitlines()
                if line.startswith("default")]
    outward = lab.run("host0", [sys.executable, "-c", OUTWARD])
    assert outward.stdout.strip() == "unreachable", outward.stdout + outward.stderr
    server = lab.popen("host0", [sys.executable, "-c", LISTEN, "5202"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        with contextlib.suppress(OSError):
            with socket.create_connection((lab.address("host0"), 5202), timeout=1) as conn:
                conn.sendall(b"hello")
        assert server.communicate(timeout=10)[0].strip() == "none"
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    assert not [link for link in sorted(netlab.root_links()) if link.startswith(PREFIX)]


@pytest.mark.timeout(120)
def test_netlab_rate_caps_both_directions(lab):
    """N bytes across a 100mbit link take at least N*8/rate seconds (0.8x for tbf's burst), each
    way; uncapped they go much faster."""
    nbytes, rate = 4_000_000, "100mbit"
    floor = 0.8 * nbytes * 8 / netlab.parse_rate(rate)
    lab.set_rate(rate)
    capped = [lab.transfer("host0", "host1", nbytes), lab.transfer("host1", "host0", nbytes)]
    lab.set_rate("none")
    uncapped = lab.transfer("host0", "host1", nbytes)
    assert min(capped) >= floor, (capped, floor)
    assert uncapped < min(capped) / 3, (uncapped, capped)
