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
        for word in hook["entry"].split()[1:]:  # the scripts it runs are there
            assert not word.endswith((".py", ".sh")) or (REPO / word).is_file(), hook


def test_every_test_file_and_tool_the_text_names_exists():
    """The lessons, docs and code point readers to tests and tools by path (`tests/e2e/test_comm.py`,
    `tools/lab/netlab.py`): each path named in a tracked file must be there, so that moving a file
    moves its mentions too."""
    import re

    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files are unknown")
    missing = set()
    for name in tracked:
        path = REPO / name
        if not path.is_file() or path.suffix in (".png", ".whl", ".gz"):
            continue
        text = path.read_text(errors="replace")
        for mention in re.findall(r"tests/[\w/]*test_\w+\.py|(?<![\w.])tools/[\w/]+\.(?:py|sh)\b", text):
            if not (REPO / mention).exists():
                missing.add(f"{name}: {mention}")
    assert not missing, "\n".join(sorted(missing))


def test_the_maintainers_map_matches_the_tree():
    """docs/MAINTAINERS.md's map: every path it names is there, and every folder of the repository
    (and each group of tools/) has its row."""
    import re

    text = (REPO / "docs" / "MAINTAINERS.md").read_text()
    table = text.split("## Map", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[3:] if line.startswith("| ")]
    named = set()
    for row in rows:
        paths = re.findall(r"`([^`]+)`", row.split(" but ")[0])
        assert paths, row
        folder = paths[0].rsplit("/", 1)[0] if "/" in paths[0].rstrip("/") else ""
        for i, path in enumerate(paths):  # `a/b.py`, `c.py`: c.py beside b.py
            path = path if i == 0 or "/" in path else f"{folder}/{path}"
            pattern = path.rstrip("/").replace("NN", "[0-9][0-9]")  # NN: a lesson number
            assert list(REPO.glob(pattern)), f"the map names {path}, which is not there"
            named.add(path.rstrip("/").split("/")[0])
            named.add("/".join(path.split("/")[:2]).rstrip("/"))
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: the tracked files are unknown")
    folders = {name.split("/")[0] for name in tracked if "/" in name and not name.startswith(".")}
    folders |= {"/".join(name.split("/")[:2]) for name in tracked if name.startswith("tools/")}
    assert folders <= named, f"folders without a row in the map: {sorted(folders - named)}"
