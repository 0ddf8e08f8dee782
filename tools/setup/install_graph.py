"""Install what lesson 4 needs (PyG and a neighbour sampler) into this Python: `make graph`.

The sampler (torch-scatter and torch-sparse; or pyg-lib) comes, in this order, from
1. a folder of prebuilt wheels, when it holds ones for this Python (COURSE_WHEELS, default
   ../shared/wheels);
2. PyG's wheel index for the installed torch and CUDA, when it answers and lists wheels for this
   Python (COURSE_PYG_INDEX overrides its address; a file:// folder works);
3. the sources on PyPI, compiled here against the installed torch: announced first, since it takes
   about 15 minutes on 2 cores and pip prints nothing meanwhile.

    python tools/setup/install_graph.py [--dry-run]
"""
import argparse
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLER = ("torch_scatter", "torch_sparse")
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def torch_tag():
    """PyG's name for the installed torch: torch-2.14.0+cpu, torch-2.14.0+cu130, ..."""
    import torch

    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return f"torch-{major_minor}.0+{cuda}"


def wheels_for_this_python(names):
    """The wheels among `names` (file names or links) that fit this Python: all of the sampler's."""
    fitting = {package: [n for n in names if re.match(rf"{package}-[^-]+-{PYTHON_TAG}-", Path(n).name)]
               for package in SAMPLER}
    return fitting if all(fitting.values()) else None


def choose(wheels_dir, index_url, timeout=10):
    """("wheels", folder), ("index", url) or ("source", None): where the sampler comes from."""
    folder = Path(wheels_dir)
    if folder.is_dir() and wheels_for_this_python([p.name for p in folder.glob("*.whl")]):
        return "wheels", str(folder)
    try:
        with urllib.request.urlopen(index_url, timeout=timeout) as response:
            page = response.read().decode(errors="replace")
    except (OSError, ValueError):  # offline, or no page for this torch
        page = ""
    links = re.findall(r'href="([^"]+\.whl)[^"]*"', page)
    if wheels_for_this_python([link.split("/")[-1].replace("%2B", "+") for link in links]):
        return "index", index_url
    return "source", None


def pip(*args):
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "-r", str(REPO / "requirements-graph.txt"), "-c", str(REPO / "constraints.txt"), *args]
    return subprocess.run(command).returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="only say where the sampler would come from")
    args = parser.parse_args()
    wheels = os.environ.get("COURSE_WHEELS", str(REPO.parent / "shared" / "wheels"))
    index = os.environ.get("COURSE_PYG_INDEX", f"https://data.pyg.org/whl/{torch_tag()}.html")
    source, where = choose(wheels, index)
    message = {"wheels": f"PyG's sampler: prebuilt wheels from {where}",
               "index": f"PyG's sampler: wheels from PyG's index, {where}",
               "source": "PyG's sampler: no prebuilt wheel fits this Python and torch, so torch-scatter "
                         "and torch-sparse are compiled from source: about 15 minutes on 2 cores"}[source]
    print(message, flush=True)
    if args.dry_run:
        return
    extra = {"wheels": ["--find-links", str(where), "--no-build-isolation"],
             "index": ["--find-links", str(where), "--no-build-isolation"],
             "source": ["--no-build-isolation"]}[source]
    sys.exit(pip(*extra))


if __name__ == "__main__":
    main()
