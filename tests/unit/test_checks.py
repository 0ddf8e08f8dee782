"""The hardening's and the lessons' checks, in-process: the replica check, the preparation turns'
group, a snapshot's leftovers, the start method."""
import pytest
from helpers import load_script


def test_a_run_that_diverged_is_not_called_a_desync(one_rank_group):
    """Replicas that all hold NaN are equal (DDP kept them so): the check says the run diverged.
    Compared with `!=`, NaN differs from itself, and rank 0 was said to differ from rank 0."""
    import torch

    debug = load_script("mnist_ddp_debug")
    model = torch.nn.Module()
    model.module = torch.nn.Linear(3, 2)
    debug.check_replicas(model, steps=1)  # finite and equal: quiet
    with torch.no_grad():
        model.module.bias[1] = float("nan")
    with pytest.raises(debug.UsageError) as err:
        debug.check_replicas(model, steps=7)
    assert "training diverged by step 7: bias holds NaN or inf" in str(err.value)
    assert "differ" not in str(err.value)


def test_the_preparation_turns_wait_in_a_gloo_group_whatever_the_backend(monkeypatch, one_rank_group):
    """Under NCCL the waiting ranks would sit in a GPU collective for up to --prepare-timeout; the
    turns make a Gloo group of their own (in-process, one rank)."""
    cpu = load_script("mnist_ddp_cpu")
    made, new_group = [], cpu.dist.new_group

    def spy(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    monkeypatch.setattr(cpu.dist, "new_group", spy)
    choice = cpu.hardening.prepare_in_turns(lambda first: f"prepared {first}", "auto", 0, 60)
    assert choice == "prepared auto" and made == ["gloo"]


@pytest.mark.parametrize("script", ["ddp_hardening"])
def test_progress_lines_when_the_output_is_not_a_terminal(monkeypatch, capsys, script):
    """A notebook's cell or a log is no terminal: rank 0 prints a line now and then, at most one
    every 5 s and 20 an epoch, each with the step, the rate and the time left, never starting as
    the epoch's summary does ("epoch 1: ..."). A clock that moves 1 s per step stands in."""
    import torch

    module = load_script(script)
    clock = iter(range(10**6))
    monkeypatch.setattr(module.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(module.sys.stdout, "isatty", lambda: False)
    steps = [(torch.zeros(8, 1), torch.zeros(8)) for _ in range(400)]
    assert list(module.progress(steps, "epoch 1", True)) == steps  # every step, in order
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20  # 400 s of steps: one every 5 s would be 80
    assert all(not line.startswith("epoch") for line in lines)
    first = lines[0]
    assert first.startswith("  [epoch 1] ") and "/400 steps" in first and "samples/s" in first
    assert first.endswith(" s left")
    assert list(module.progress(steps, "epoch 1", False)) == steps and capsys.readouterr().out == ""


def test_free_ports_are_drawn_where_no_other_connection_can_take_them(monkeypatch):
    """free_port()'s port is bound seconds later (by rank 0 after the workers start, by a torchrun
    agent, a Jupyter server): meanwhile, every connection this machine opens and every bind to port 0
    takes a port of ip_local_port_range, so one drawn there by the OS could be gone (a kernel of the
    suite once failed so). Drawn below that range, it cannot; a port in use is passed over; where
    the range cannot be read, or leaves no room below it, the OS picks."""
    import socket
    from pathlib import Path

    hardening = load_script("ddp_hardening")
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range: not Linux")
    low, high = map(int, ranges.read_text().split())
    if low <= 20000:
        pytest.skip(f"this machine's ip_local_port_range starts at {low}: no room below it")
    assert all(20000 <= hardening.free_port() < low for _ in range(200))
    # The control: what the OS hands out, to outgoing connections and to port 0, lies in the range.
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        bound = [socket.socket() for _ in range(50)]
        for s in bound:
            s.bind(("", 0))
        taken = [s.getsockname()[1] for s in clients + bound]
        for s in clients + bound:
            s.close()
    assert all(low <= port <= high for port in taken)
    # A port in use is passed over; when every draw is in use, the OS's pick.
    with socket.create_server(("", hardening.free_port())) as busy:
        port = busy.getsockname()[1]
        monkeypatch.setattr(hardening.random.SystemRandom, "sample", lambda self, ports, k: [port] * k)
        picked = hardening.free_port()
        assert picked != port and low <= picked <= high
    monkeypatch.undo()

    def not_linux(*args, **kwargs):
        raise FileNotFoundError("no /proc")

    monkeypatch.setattr(hardening, "open", not_linux, raising=False)
    assert low <= hardening.free_port() <= high
