"""torchrun on two "machines": two torchrun agents on this one (--nnodes 2, static rendezvous), each
told a different --data-dir, as two machines without a shared filesystem would see it. The data
must be prepared on each machine (once), rank 0 decides which dataset, and a failure on either
machine stops both with one line. Also: a first preparation longer than --timeout is waited for."""
import shutil
import socket
import subprocess
import sys
import time

import pytest
from helpers import (OFFLINE, REPO, SCRIPTS, assert_one_line_error, free_port, needs_sampler, read_metrics,
                     run_script, script_env, torchrun, two_machines)

MNIST = ["--model", "linear", "--max-steps", 20]


def test_a_machine_without_the_data_prepares_its_own_copy(tmp_path, data_args):
    dataset = data_args[1]
    other = tmp_path / "other-machine"
    out = tmp_path / "m.json"
    results, _ = two_machines("mnist_ddp_cpu.py", [
        [*MNIST, *data_args, "--metrics-json", out],
        [*MNIST, "--dataset", "auto", "--data-dir", other]], env=OFFLINE)
    assert all(code == 0 for code, _ in results), results
    assert sum(out.count("done:") for _, out in results) == 1
    # rank 0 chose the dataset (its own copy); the other machine fetched the same one for itself
    assert read_metrics(out)["dataset"] == dataset
    folder = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}[dataset]
    assert len(list((other / folder / "raw").glob("*-ubyte"))) == 4


def test_a_machine_that_cannot_prepare_the_data_stops_both_in_one_line(blocker, data_args):
    results, seconds = two_machines("mnist_ddp_cpu.py", [
        [*MNIST, *data_args],
        [*MNIST, *data_args[:2], "--data-dir", blocker / "data"]])
    line = assert_one_line_error(results, "mnist_ddp_cpu.py", "cannot use --data-dir")
    assert f"(on {socket.gethostname()})" in line  # which machine: it is not rank 0's
    assert seconds < 60


def test_gcn_other_machines_use_rank_0s_dataset(tmp_path):
    """--dataset auto: rank 0's machine has ogbn-products, the other machine has nothing and is
    offline. Before, it quietly took the synthetic graph (and DDP failed on mismatched shapes);
    now it must fetch ogbn-products too, and says that it cannot."""
    needs_sampler()
    pytest.importorskip("ogb", reason="ogb is not installed (make setup installs it)")
    from graph_files import write_ogbn_products_raw

    write_ogbn_products_raw(tmp_path / "first")
    flags = ["--device", "cpu", "--dataset", "auto", "--batch-size", 60, "--hidden", 16, "--max-steps", 3]
    results, seconds = two_machines("gcn_ddp.py", [
        [*flags, "--data-dir", tmp_path / "first"],
        [*flags, "--data-dir", tmp_path / "second"]], env=OFFLINE)
    assert_one_line_error(results, "gcn_ddp.py", "ogbn-products is not in")
    assert seconds < 120

    # With a copy of the raw files there, each machine processes its own (3 ranks in all).
    shutil.rmtree(tmp_path / "second", ignore_errors=True)
    write_ogbn_products_raw(tmp_path / "second")
    out = tmp_path / "m.json"
    results, _ = two_machines("gcn_ddp.py", [
        [*flags, "--data-dir", tmp_path / "first", "--metrics-json", out],
        [*flags, "--data-dir", tmp_path / "second"]], procs=(1, 2), env=OFFLINE)
    assert all(code == 0 for code, _ in results), results
    metrics = read_metrics(out)
    assert (metrics["world_size"], metrics["dataset"]) == (3, "ogbn-products")
    for machine in ("first", "second"):  # processed, and sorted for the ranks to map, on each
        processed = tmp_path / machine / "ogbn_products" / "processed"
        assert (processed / "geometric_data_processed.pt").exists()
        assert (processed / "sorted_for_ddp.pt").exists()


def test_a_preparation_longer_than_the_timeout_is_waited_for(tmp_path):
    """Under torchrun the ranks load the graph in turns; rank 1 waits for rank 0 (seconds here),
    longer than --timeout 1, which bounds the training's collectives, not the preparation."""
    needs_sampler()
    out = tmp_path / "m.json"
    r = run_script("gcn_ddp.py", "--device", "cpu", "--dataset", "synthetic", "--num-nodes", 200_000,
                   "--batch-size", 64, "--hidden", 16, "--max-steps", 2, "--eval-nodes", 500,
                   "--timeout", 1, "--metrics-json", out, launcher=torchrun(2), timeout=240)
    assert r.returncode == 0, r.stderr
    assert read_metrics(out)["world_size"] == 2


def test_only_rank_0s_machine_checks_the_output_paths(tmp_path, blocker, data_args):
    """Only rank 0 writes --save and --metrics-json. A path that the other machine cannot create
    used to stop its rank before the process group existed, and rank 0 then waited out --timeout."""
    out = tmp_path / "m.json"
    results, seconds = two_machines("mnist_ddp_cpu.py", [
        [*MNIST, *data_args, "--metrics-json", out, "--timeout", 60],
        [*MNIST, *data_args, "--metrics-json", blocker / "m.json", "--timeout", 60]])
    assert all(code == 0 for code, _ in results), results
    assert read_metrics(out)["world_size"] == 2
    assert seconds < 50


# A refusal that only one machine makes (its GPUs, its libraries; played here by a flag that only
# that machine's command has): the roll call before the process group stops both machines within
# seconds, with one line from rank 0. Before it, the other machine waited out --timeout (then a Gloo
# traceback), or, when rank 0's machine refused, the other printed a 40-line C++ warning.
GPU_SCRIPT_ON_CPU = [*MNIST, "--device", "cpu", "--timeout", 120]


@pytest.mark.parametrize("refusing", [1, 0], ids=["other-machine-refuses", "rank-0s-machine-refuses"])
def test_a_refusal_on_one_machine_stops_both_at_once(refusing, data_args):
    node_args = [[*GPU_SCRIPT_ON_CPU, *data_args] for _ in range(2)]
    node_args[refusing] += ["--amp", "fp16"]
    results, seconds = two_machines("mnist_ddp_gpu.py", node_args, procs=(2, 2))
    line = assert_one_line_error(results, "mnist_ddp_gpu.py", "--amp fp16 is for GPUs")
    assert f"(rank 2, on {socket.gethostname()})" in line if refusing else "(rank" not in line
    assert not any("Connection was likely closed" in out for _, out in results), results
    assert seconds < 60  # not --timeout


def test_gcn_refusal_on_one_machine_stops_both_at_once():
    needs_sampler()
    flags = ["--device", "cpu", "--dataset", "synthetic", "--num-nodes", 2000, "--timeout", 120]
    results, seconds = two_machines("gcn_ddp.py", [flags, [*flags, "--num-neighbors", 5]])
    assert_one_line_error(results, "gcn_ddp.py", "takes 2 fan-outs")
    assert seconds < 60


@pytest.mark.parametrize("typo_on", [1, 0], ids=["other-machine", "rank-0s-machine"])
def test_a_parser_error_on_one_machine_stops_both_at_once(typo_on, data_args):
    """One machine's command has a typo. Its ranks answer the roll call with the parser's message,
    so rank 0 says it once for both machines; before, the other machine waited out --timeout."""
    node_args = [[*MNIST, *data_args, "--timeout", 120] for _ in range(2)]
    node_args[typo_on] += ["--epochs", 0]
    results, seconds = two_machines("mnist_ddp_cpu.py", node_args, procs=(2, 2))
    line = assert_one_line_error(results, "mnist_ddp_cpu.py", "--epochs: must be positive, got 0")
    assert f"(rank 2, on {socket.gethostname()})" in line if typo_on else "(rank" not in line
    assert seconds < 60  # not --timeout


def test_a_rank_that_never_reports_is_waited_for_within_the_timeout(tmp_path, data_args):
    """The other machine runs something that fails before the roll call (here: a script that only
    exits; in life an old copy of the script, a crash at import): rank 0's machine waits --timeout
    in the roll call, then says so in one line."""
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.exit('crashed before the roll call')\n")
    results, seconds = two_machines(None, [
        [SCRIPTS / "mnist_ddp_cpu.py", *MNIST, *data_args, "--timeout", 5], [crash]], procs=(2, 2))
    assert all(code != 0 for code, _ in results), results
    [line] = [line for line in results[0][1].splitlines() if line.startswith("mnist_ddp_cpu.py: error:")]
    assert "not every rank reported for the roll call (waited up to --timeout 5 s)" in line
    assert not any("]: Traceback" in out for _, out in results), results
    assert seconds < 60


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lost", ["agent", "machine"])
def test_a_machine_lost_mid_training_ends_the_job_in_one_line(lost, data_args):
    """Mid-training, machine B's torchrun agent is killed (its ranks, in sessions of their own,
    used to train on, and machine A's agent waited for minutes), or every process of machine B is.
    B's ranks end with their agent, within seconds; A's rank ends too, in one line that says a
    peer was lost, not a Gloo traceback."""
    import psutil

    port, agents = free_port(), []
    for node in (0, 1):
        launcher = ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1"]
        command = [sys.executable, *launcher, str(SCRIPTS / "mnist_ddp_cpu.py"), "--model", "linear",
                   "--epochs", "200", "--timeout", "60", *map(str, data_args)]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       cwd=REPO, env=script_env()))
    try:
        lines = []
        for line in agents[0].stdout:  # wait until training runs
            lines.append(line)
            if line.startswith("epoch 1:"):
                break
        agent_b = psutil.Process(agents[1].pid)
        ranks_b = agent_b.children(recursive=True)
        assert ranks_b
        start = time.monotonic()
        for process in [agent_b, *ranks_b] if lost == "machine" else [agent_b]:
            process.kill()
        gone, alive = psutil.wait_procs(ranks_b, timeout=15)
        assert not alive, f"machine B's ranks outlived their agent: {alive}"
        output = "".join(lines) + agents[0].communicate(timeout=120)[0]
        assert agents[0].returncode != 0 and time.monotonic() - start < 60
    finally:
        for agent in agents:
            agent.kill()
    errors = [line for line in output.splitlines() if line.startswith("mnist_ddp_cpu.py: error:")]
    assert len(errors) == 1 and "rank 0 lost its connection to another rank" in errors[0], output
    assert "]: Traceback" not in output, output


