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


def test_every_test_file_the_text_names_exists():
    """The lessons, docs and code point readers to tests by path (`tests/e2e/test_comm.py`): each
    path named in a tracked file must be there, so that moving a test moves its mentions too."""
    import re

    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files are unknown")
    missing = set()
    for name in tracked:
        path = REPO / name
        if not path.is_file() or path.suffix in (".png", ".whl", ".gz"):
            continue
        for mention in re.findall(r"tests/[\w/]*test_\w+\.py", path.read_text(errors="replace")):
            if not (REPO / mention).exists():
                missing.add(f"{name}: {mention}")
    assert not missing, "\n".join(sorted(missing))
