"""docs/lessons/: every lesson and solution rendered with a full run's outputs (make pages,
tools/generate/render_lessons.py), kept current: each page's stamp hashes the notebook's cells and
the scripts it launches, and a page whose notebook or scripts changed since is stale. These tests
compare hashes and links; they render nothing (the renderer's own test renders one small executed
notebook)."""
import json
import re
import subprocess
import sys

import nbformat
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "generate"))
import render_lessons  # noqa: E402

NOTEBOOKS = render_lessons.notebooks()


def page_of(notebook):
    return render_lessons.PAGES / f"{notebook.stem}.md"


def again(notebook, stamp):
    return (f"`make pages NB={notebook.stem}` renders it again ({stamp['minutes']:.1f} minutes on "
            f"{stamp['machine']}, {stamp['date']})")


def test_there_is_a_notebook_for_each_lesson_and_solution():
    assert len([nb for nb in NOTEBOOKS if nb.parent.name == "notebooks"]) >= 13
    assert len([nb for nb in NOTEBOOKS if nb.parent.name == "solutions"]) >= 13


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda nb: nb.stem)
def test_each_page_is_current_with_its_notebook_and_scripts(notebook):
    page = page_of(notebook)
    assert page.exists(), f"{notebook.name} has no rendered page: `make pages NB={notebook.stem}` renders it"
    stamp = render_lessons.stamp_of(page)
    assert stamp is not None, f"{page.name} has no stamp: `make pages NB={notebook.stem}` renders it again"
    assert stamp["notebook"] == str(notebook.relative_to(REPO))
    stale = f"{page.name} is stale:"
    assert stamp["cells"] == render_lessons.cells_hash(notebook), (
        f"{stale} {notebook.name}'s cells changed since it was rendered; {again(notebook, stamp)}")
    now = render_lessons.scripts_hashes(notebook)
    changed = sorted({script for script, _ in set(now.items()) ^ set(stamp["scripts"].items())})
    assert not changed, f"{stale} {', '.join(changed)} changed since then; {again(notebook, stamp)}"
    for key in ("machine", "torch", "data", "date"):
        assert stamp[key] and stamp[key] in page.read_text(), key  # said to the reader, not only stamped


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda nb: nb.stem)
def test_each_pages_links_and_figures_resolve(notebook):
    """Relative links and images, as a Markdown viewer and GitHub resolve them: from the page's folder."""
    page = page_of(notebook)
    if not page.exists():
        pytest.skip("no page (the test above fails for it)")
    text = page.read_text()
    targets = render_lessons.links(text)
    assert targets, page.name
    for target in targets:
        if re.match(r"^([a-z]+:|#)", target):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which is not there"
        assert path.is_relative_to(REPO), f"{page.name} links outside the repository: {target}"
    for name in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):  # every image a real picture
        assert (page.parent / name).read_bytes()[:4] in (b"\x89PNG", b"<svg", b"<?xm"), name


def test_the_folders_index_lists_every_lesson_and_its_solutions():
    index = (render_lessons.PAGES / "README.md").read_text()
    for notebook in NOTEBOOKS:
        assert f"({notebook.stem}.md)" in index, notebook.name


def test_the_readme_links_each_lessons_page_beside_its_notebook():
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| ")]
    for notebook in (nb for nb in NOTEBOOKS if nb.parent.name == "notebooks"):
        row = next((r for r in rows if f"(notebooks/{notebook.name})" in r), None)
        assert row is not None, notebook.name
        assert f"(docs/lessons/{notebook.stem}.md)" in row, f"README: {notebook.name}'s row links no page"


def test_the_renderer_writes_outputs_figures_and_links_that_resolve(tmp_path):
    """render_lessons.py --executed: a small executed notebook becomes a page with its text output,
    its plot extracted beside it, a figure of the repository and a link to another lesson's page, both
    made relative to the page's folder, and a stamp with the hashes the tests above compare."""
    import base64

    executed = tmp_path / "executed"
    executed.mkdir()
    png = base64.b64encode((REPO / "figures" / "ddp_data_flow.png").read_bytes()).decode()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson 9: a title\n![flow](../figures/ddp_data_flow.png)\n"
                                              "[the next lesson](10_beyond_ddp_sharding.ipynb)"),
                nbformat.v4.new_code_cell("print('hi')  # runs mnist_single.py", outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text="an output \x1b[31mof the run"),
                    nbformat.v4.new_output("display_data", data={"image/png": png, "text/plain": "<Fig>"})])]
    nbformat.write(nb, executed / "09_a_title.ipynb")
    out = REPO / "build" / "test_pages" / tmp_path.name
    r = subprocess.run([sys.executable, str(REPO / "tools" / "generate" / "render_lessons.py"), "--executed",
                        str(executed), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = (out / "09_a_title.md").read_text()
    assert "an output of the run" in text  # the colours' escape codes gone
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert "../../../figures/ddp_data_flow.png" in images, images  # from build/test_pages/<name>/
    made = [i for i in images if i.startswith("09_a_title_files/")]
    assert len(made) == 1 and (out / made[0]).read_bytes()[:4] == b"\x89PNG", images
    assert "(10_beyond_ddp_sharding.md)" in text  # a lesson's link goes to its page
    stamp = render_lessons.stamp_of(out / "09_a_title.md")
    assert stamp["cells"] == render_lessons.cells_hash(executed / "09_a_title.ipynb")
    assert list(stamp["scripts"]) == ["ddp_scripts/mnist_single.py"]
    assert json.loads(json.dumps(stamp)) == stamp


def test_a_script_named_in_a_notebooks_code_is_one_it_launches():
    lesson9 = next(nb for nb in NOTEBOOKS if nb.name.startswith("09_"))
    assert render_lessons.launched_scripts(lesson9)[:2] == ["ddp_scripts/allreduce_by_hand.py",
                                                            "ddp_scripts/mnist_by_hand.py"]
    assert all((REPO / s).is_file() for nb in NOTEBOOKS for s in render_lessons.launched_scripts(nb))


def test_the_hash_of_a_notebooks_cells_leaves_out_only_its_time_line(tmp_path):
    """compute_times.py writes a lesson's **Time:** line after its run, from that run: the line leaves
    the page current; any other edit of the cell makes it stale."""
    def hash_of(first_cell):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(first_cell), nbformat.v4.new_code_cell("SMOKE = True")]
        path = tmp_path / "01_x.ipynb"
        nbformat.write(nb, path)
        return render_lessons.cells_hash(path)

    line = ("**Time:** {} in smoke mode (`SMOKE = True`), 70 s in full, measured on AMD EPYC, 2 cores, "
            "no GPU (2026-12-07; 2026-12-06).")
    cell = "# Lesson\n\n{}\n\n**Hardware:** any CPU."
    first = cell.format(line.format("20 s"))
    assert hash_of(first) == hash_of(cell.format(line.format("3 minutes")))
    assert hash_of(first) != hash_of(first.replace("any CPU", "a CPU"))
