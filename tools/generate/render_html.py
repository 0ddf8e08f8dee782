"""Render the executed notebooks (what `make notebooks` wrote in build/notebooks/) as HTML pages,
with an index page, in build/html/: the course with a full run's outputs, readable in any browser
without Jupyter.

    python tools/generate/render_html.py [--notebooks build/notebooks] [--out build/html]
"""
import argparse
import html
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def title(path):
    """The notebook's first Markdown heading, else its file name."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return path.stem


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=REPO / "build" / "notebooks")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "html")
    args = parser.parse_args()
    notebooks = sorted(args.notebooks.glob("*.ipynb"))
    if not notebooks:
        sys.exit(f"render_html: no executed notebooks in {args.notebooks}: run `make notebooks` "
                 f"(or `make notebooks SMOKE=1` for tiny runs) first")
    from nbconvert import HTMLExporter

    args.out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(embed_images=True)  # the figures inside each page
    for nb in notebooks:
        # Relative paths as in notebooks/, where the notebook was written: its figures are found
        # there, and links go to the other pages here, or to the repository's files.
        page, _ = exporter.from_filename(str(nb), resources={"metadata": {"path": str(REPO / "notebooks")}})
        page = re.sub(r'href="([^":#]+)\.ipynb', r'href="\1.html', page)
        page = page.replace('href="../', f'href="{os.path.relpath(REPO, args.out.resolve())}/')
        (args.out / f"{nb.stem}.html").write_text(page)
    items = "\n".join(f'  <li><a href="{html.escape(nb.stem)}.html">{html.escape(title(nb))}</a></li>'
                      for nb in notebooks)
    (args.out / "index.html").write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>PyTorch DDP, hands-on</title></head>\n"
        "<body>\n<h1>PyTorch DistributedDataParallel, hands-on</h1>\n"
        f"<p>The lessons as executed by <code>make notebooks</code> on the machine that ran it.</p>\n"
        f"<ol>\n{items}\n</ol>\n</body></html>\n")
    print(f"wrote {len(notebooks)} pages and {args.out / 'index.html'}")


if __name__ == "__main__":
    main()
