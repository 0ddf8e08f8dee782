"""Execute a notebook's code cells in one plain Python process, for a machine without Jupyter (a
GPU machine with only torch and the course's scripts: no papermill, no IPython). `IPython.display`
is replaced by a stand-in that prints; the working directory is the notebook's folder, as under
`make notebooks`.

    python tools/generate/run_notebook_plain.py notebooks/03_ddp_gpu_nccl.ipynb [--smoke]

Exits non-zero at the first cell that raises, with its traceback. `make notebooks` (papermill,
a real kernel) remains the check of a notebook as readers run it.
"""
import argparse
import json
import os
import sys
import types
from pathlib import Path


class Markdown:
    def __init__(self, data=""):
        self.data = data

    def __repr__(self):
        return self.data


class Image:
    def __init__(self, filename=None, **kwargs):
        self.filename = filename

    def __repr__(self):
        return f"[image: {self.filename}]"


def display(*objects, **kwargs):
    for obj in objects:
        print(repr(obj))


def install_display_stand_in():
    module = types.ModuleType("IPython.display")
    module.Markdown, module.Image, module.display = Markdown, Image, display
    package = types.ModuleType("IPython")
    package.display = module
    sys.modules["IPython"], sys.modules["IPython.display"] = package, module


def code_cells(path):
    notebook = json.loads(Path(path).read_text())
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            # IPython magics and shell escapes have no meaning here
            lines = [("# " + line) if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines()]
            yield cell.get("id", str(index)), "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--smoke", action="store_true", help="COURSE_SMOKE=1: the notebook's tiny runs")
    args = parser.parse_args()
    path = args.notebook.resolve()
    if args.smoke:
        os.environ["COURSE_SMOKE"] = "1"
    install_display_stand_in()
    os.chdir(path.parent)
    sys.path.insert(0, str(path.parent))
    namespace = {"__name__": "__main__"}
    for cell_id, source in code_cells(path):
        print(f"----- {path.name} {cell_id}", flush=True)
        exec(compile(source, f"{path.name}:{cell_id}", "exec"), namespace)
    print(f"----- {path.name}: every code cell ran", flush=True)


if __name__ == "__main__":
    main()
