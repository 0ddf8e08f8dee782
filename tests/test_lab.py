"""`make lab`: JupyterLab on notebooks/, with the project's environment as the kernel. Started here
through the Makefile, headless, on a free port, and asked for its notebook list and kernels
through its REST API."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (make setup installs it)")


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.skipif(Path(sys.executable).parent != REPO / ".venv" / "bin",
                    reason="make lab uses the project's .venv; this is another Python")
@pytest.mark.timeout(180)
def test_make_lab_serves_the_notebooks_with_this_environment_as_kernel(tmp_path):
    port, token = free_port(), "course-test"
    flags = f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.runtime_dir={tmp_path}"
    # A "python3" kernelspec of another Python in the user's own Jupyter folder, as many machines
    # have: the course's environment must still be the kernel.
    decoy = tmp_path / "data" / "kernels" / "python3"
    decoy.mkdir(parents=True)
    (decoy / "kernel.json").write_text(json.dumps({
        "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "another Python", "language": "python"}))
    env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    server = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}", f"LAB_FLAGS={flags}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)

    def api(path):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/{path}?token={token}", timeout=5) as r:
            return json.load(r)

    try:
        deadline, listing = time.monotonic() + 120, None
        while listing is None:
            assert server.poll() is None, server.stderr.read()
            try:
                listing = api("contents")
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 120 s"
                time.sleep(1)
        names = {item["name"] for item in listing["content"]}
        assert {p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")} <= names
        specs = api("kernelspecs")
        kernel = specs["kernelspecs"][specs["default"]]["spec"]
        assert specs["default"] == "python3", specs["default"]
        assert Path(kernel["argv"][0]).parent == REPO / ".venv" / "bin", kernel  # this environment
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
