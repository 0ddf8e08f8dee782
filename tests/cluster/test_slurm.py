"""tools/lab/slurm_lab.py: a Slurm cluster of two nodes, one per netlab host, that enforces CPUs per task
(task/affinity), runs a job across both nodes and is stopped and removed afterwards (root only:
skipped otherwise; slurm-wlm is installed with apt-get when absent)."""
import gzip
import json
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "lab"))
import netlab  # noqa: E402
import slurm_lab  # noqa: E402

PREFIX = "ddptest-slurm"  # not the default: a cluster someone brought up by hand stays up
# The first test using the cluster may install slurm-wlm first (apt-get, tens of seconds or more).
TIMEOUT = 120 if slurm_lab.which("slurmctld") else 900
REPORT = "import os, socket; print(os.environ['SLURM_PROCID'], socket.gethostname(), " \
         "socket.getfqdn(), len(os.sched_getaffinity(0)))"


@pytest.fixture(scope="module")
def slurm_ready():
    reason = netlab.missing_requirements() or slurm_lab.missing_requirements()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(slurm_ready):
    with netlab.Lab(prefix=PREFIX) as lab, slurm_lab.Cluster(lab) as cluster:
        yield cluster


def job_script(cluster, name, body):
    path = cluster.workdir / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    return path


def man_page(name):
    path = Path(f"/usr/share/man/man5/{name}.5.gz")
    if not path.exists():
        pytest.skip(f"{path} not found: cannot check the configuration's keys")
    return gzip.decompress(path.read_bytes()).decode(errors="replace").replace("\\", "")


@pytest.mark.timeout(TIMEOUT)
def test_slurm_config_keys_and_plugins_exist_in_this_slurm(slurm_ready, tmp_path):
    conf = slurm_lab.slurm_conf(tmp_path, [("host0", "10.77.0.1"), ("host1", "10.77.0.2")],
                                ("host0", "10.77.0.1"), ports=(6817, 6818))
    for text, page in ((conf, "slurm.conf"), (slurm_lab.CGROUP_CONF, "cgroup.conf")):
        manual = man_page(page)
        keys = {line.split("=")[0] for line in text.splitlines() if "=" in line}
        assert not [k for k in keys if f"fB{k}" not in manual], page
    plugins = re.findall(r"=(\w+)/(\w+)$", conf, re.MULTILINE)
    plugin_dir = Path(slurm_lab.plugin_dir())
    assert not [f"{kind}/{name}" for kind, name in plugins if not (plugin_dir / f"{kind}_{name}.so").exists()]
    assert slurm_lab.slurm_version() >= (22, 5)


@pytest.mark.timeout(TIMEOUT)
def test_slurm_cluster_comes_up_with_two_nodes(cluster):
    out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %c %T"], check=True).stdout
    assert sorted(out.split("\n")[:-1]) == ["host0 2 idle", "host1 2 idle"]
    assert cluster.run(["hostname"]).stdout.strip() == "host0"  # where the commands run


@pytest.mark.timeout(TIMEOUT)
def test_slurm_cpus_per_task_reach_a_step_only_when_srun_repeats_them(cluster):
    """Slurm >= 22.05: srun no longer takes --cpus-per-task from sbatch; a step without it gets one
    CPU per task, pinned by task/affinity."""
    script = job_script(cluster, "cpus.sh", f"""\
        echo "repeated $(srun --cpus-per-task=2 python -c "{REPORT}")"
        echo "control $(srun python -c "{REPORT}")"
        """)
    job = cluster.sbatch(script, options=["--cpus-per-task=2"], timeout=60)
    assert job.ok, (job.state, job.exit_code, job.output)
    cpus = {line.split()[0]: line.split()[-1] for line in job.output.splitlines()}
    assert cpus == {"repeated": "2", "control": "1"}, job.output


@pytest.mark.timeout(TIMEOUT)
def test_slurm_two_node_job_runs_one_task_on_each_node(cluster):
    script = job_script(cluster, "nodes.sh", f"""\
        srun python -c "{REPORT}"
        """)
    job = cluster.sbatch(script, options=["--nodes=2", "--ntasks-per-node=1"], timeout=60)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    tasks = sorted(line.split()[:3] for line in job.output.splitlines())
    assert tasks == [["0", "host0", "host0"], ["1", "host1", "host1"]], job.output


@pytest.mark.timeout(TIMEOUT)
def test_slurm_job_exit_code_and_environment_come_back(cluster):
    script = job_script(cluster, "fails.sh", """\
        echo "$SLURM_CONF $(command -v python)"
        exit 3
        """)
    job = cluster.sbatch(script, timeout=60)
    assert (job.state, job.exit_code) == ("FAILED", 3)
    assert job.output.split() == [str(cluster.conf), str(netlab.venv_bin() / "python")]
    assert Path(job.stdout_path).parent == cluster.workdir  # not in the caller's folder


@pytest.mark.timeout(TIMEOUT + 240)
@pytest.mark.parametrize("sbatch, cpus", [("slurm_ddp.sbatch", 2), ("slurm_tasks.sbatch", 1)],
                         ids=["one-torchrun-per-node", "one-task-per-rank"])
def test_slurm_runs_the_course_batch_files_unchanged(cluster, data_args, sbatch, cpus):
    """launch/'s two batch files, submitted as they are with sbatch (only command-line overrides:
    CPUs that two 2-CPU nodes have, the output file, a short run): four ranks on two nodes train,
    the rendezvous at the allocation's first node, and the job ends COMPLETED with exit code 0."""
    out = cluster.workdir / sbatch
    out.mkdir()
    flags = ["--model", "linear", "--epochs", "1", "--max-steps", "20", "--timeout", "90",
             "--snapshot", str(out / "s.pt"), "--metrics-json", str(out / "m.json"), *data_args]
    options = [f"--cpus-per-task={cpus}", f"--output={out}/job-%j.out"]
    job = cluster.sbatch(REPO / "launch" / sbatch, *flags, options=options, cwd=REPO, timeout=240)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    metrics = json.loads((out / "m.json").read_text())
    assert metrics["world_size"] == 4 and metrics["epochs"][-1]["steps"] == 20, metrics
    assert re.search(r"^done: linear on \S+, 4 processes", job.output, re.M), job.output


@pytest.mark.timeout(TIMEOUT)
def test_slurm_down_stops_the_daemons_and_removes_everything(cluster):
    """Last in this file: it takes the module's cluster and lab down (down() may run twice)."""
    workdir, lab = cluster.workdir, cluster.lab
    daemons = list(cluster.daemon_pids.values())
    assert len(daemons) == 3
    cluster.down()
    lab.down()
    assert not workdir.exists()
    assert not [pid for pid in daemons if slurm_lab.alive(pid)]
    assert netlab.leftovers(PREFIX) == []


@pytest.mark.timeout(TIMEOUT)
def test_slurm_one_node_on_loopback(slurm_ready):
    """Without a lab: one node, "localhost", in this machine's own network."""
    with slurm_lab.Cluster(prefix="ddptest-slurm1") as cluster:
        workdir = cluster.workdir
        script = job_script(cluster, "tasks.sh", f"""\
            srun python -c "{REPORT}"
            """)
        job = cluster.sbatch(script, options=["--ntasks=2"], timeout=60)
        assert job.ok, job.output
        assert sorted(line.split()[0] for line in job.output.splitlines()) == ["0", "1"]
        daemons = list(cluster.daemon_pids.values())
    assert not workdir.exists()
    assert not [pid for pid in daemons if slurm_lab.alive(pid)]
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("ddptest-slurm1")]
