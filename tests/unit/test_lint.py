"""ruff, with the rules pyproject.toml selects, over the repository (as the pre-commit hook)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (make setup installs it)")
    r = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_pre_commit_configuration_is_valid_and_local():
    """The hooks run the project's own tools (nothing is fetched at commit time)."""
    import yaml

    pre_commit = Path(sys.executable).parent / "pre-commit"
    if not pre_commit.exists():
        pytest.skip("pre-commit is not installed (make setup installs it)")
    config = REPO / ".pre-commit-config.yaml"
    r = subprocess.run([str(pre_commit), "validate-config", str(config)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    repos = yaml.safe_load(config.read_text())["repos"]
    assert {repo["repo"] for repo in repos} == {"local"}
    for hook in (h for repo in repos for h in repo["hooks"]):
        assert hook["entry"].startswith(".venv/bin/"), hook
