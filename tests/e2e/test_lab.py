"""`make lab`: JupyterLab on the repository, opened at notebooks/, with the project's environment as
the kernel. Started here through the Makefile, headless, on a free port (one server for this
module); asked for its notebook list and kernels through its REST API, and each lesson opened in
a browser as a reader opens it (from the file browser): its figures load and its relative links
lead to files the server serves."""
import importlib.util
import json
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import nbformat
import pytest
from helpers import REPO, free_port

pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (make setup installs it)")

pytestmark = [
    pytest.mark.slow,  # left out of make test-quick
    pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed"),
    pytest.mark.skipif(Path(sys.executable).parent != REPO / ".venv" / "bin",
                       reason="make lab uses the project's .venv; this is another Python"),
]

CURRENT_TAB = "#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current"  # the main area's tab in front
LESSONS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHROMIUM = shutil.which("chromium")
# Headless, as root (no sandbox), and nothing fetched from the network but the server's pages.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--no-proxy-server", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]
# Targets of inline Markdown links and images, [text](target) and ![alt](target), and of HTML's
# <a href=...> and <img src=...>
TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)")
HTML_LINK = re.compile(r"<a\b[^>]*\bhref=[\"']([^\"']+)")
HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc=[\"']([^\"']+)")


# The server is on this machine: asked directly, never through a proxy the environment names (a
# user's, or OFFLINE's: see conftest's fresh_urllib_opener).
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Lab:
    def __init__(self, port, token):
        self.url, self.token = f"http://127.0.0.1:{port}", token

    def request(self, path, method="GET"):
        """The HTTP status and body of `path` (after the server's address), with the token."""
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(f"{self.url}/{path}{sep}token={self.token}", method=method)
        try:
            with DIRECT.open(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    def api(self, path):
        status, body = self.request(f"api/{path}")
        assert status == 200, f"api/{path}: HTTP {status}"
        return json.loads(body)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lab")
    port, token = free_port(), "course-test"
    flags = "--no-browser --ServerApp.ip=127.0.0.1"
    # A "python3" kernelspec of another Python in the user's own Jupyter folder, as many machines
    # have: the course's environment must still be the kernel.
    decoy = tmp_path / "data" / "kernels" / "python3"
    decoy.mkdir(parents=True)
    (decoy / "kernel.json").write_text(json.dumps({
        "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "another Python", "language": "python"}))
    env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = tmp_path / "lab.log"
    # free_port() draws below the ports the OS hands out, so that none of the connections the suite's
    # other worker opens meanwhile takes it. Should it be taken all the same, Jupyter would quietly
    # serve on the next port (port_retries): with none allowed it exits, and the fixture says why.
    with open(log, "w") as err:
        server = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}",
                                   f"LAB_FLAGS={flags} --ServerApp.port_retries=0"], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    lab = Lab(port, token)
    deadline = time.monotonic() + 120
    while server.poll() is None:
        try:
            lab.request("api/status")
            break
        except OSError:
            if time.monotonic() > deadline:
                stop_server(server)
                raise AssertionError(f"JupyterLab did not answer in 120 s:\n{log.read_text()[-2000:]}")
            time.sleep(1)
    assert server.poll() is None, f"JupyterLab exited:\n{log.read_text()[-2000:]}"
    try:
        yield lab
    finally:
        stop_server(server)


def stop_server(server):
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_make_lab_serves_the_notebooks_with_this_environment_as_kernel(lab):
    names = {item["name"] for item in lab.api("contents/notebooks")["content"]}
    assert {p.name for p in LESSONS} <= names
    specs = lab.api("kernelspecs")
    kernel = specs["kernelspecs"][specs["default"]]["spec"]
    assert specs["default"] == "python3", specs["default"]
    assert Path(kernel["argv"][0]).parent == REPO / ".venv" / "bin", kernel  # this environment


def is_image(text, close):
    """Whether the ] at `close` ends an image's alt text, ![...], rather than a link's text."""
    depth = 0
    for i in range(close, -1, -1):
        depth += {"]": 1, "[": -1}.get(text[i], 0)
        if depth == 0:
            return i > 0 and text[i - 1] == "!"
    return False


def markdown_targets(notebook):
    """A notebook's Markdown cells (not empty): how many, and their images' and links' targets."""
    cells = [c.source for c in nbformat.read(notebook, as_version=4).cells
             if c.cell_type == "markdown" and c.source.strip()]
    images, links = [], []
    for text in cells:
        images += HTML_IMAGE.findall(text)
        links += HTML_LINK.findall(text)
        for match in TARGET.finditer(text):
            (images if is_image(text, match.start()) else links).append(match.group(1))
    return len(cells), images, links


def is_relative(target):
    """A target relative to the notebook: no scheme, host or leading /, and not only a #fragment."""
    url = urllib.parse.urlsplit(target)
    return not (url.scheme or url.netloc or url.path.startswith("/")) and bool(url.path)


def relative(targets):
    """The repository paths of the relative targets, resolved from notebooks/ as JupyterLab does."""
    return sorted(posixpath.normpath(posixpath.join("notebooks", urllib.parse.unquote(
        urllib.parse.urlsplit(t).path))) for t in targets if is_relative(t))


# Once JupyterLab has opened one notebook (the only one open), rendered its Markdown cells,
# rewritten every relative address in them (an image's src, a link's href: kept as written until
# then) and the browser has loaded each image; or once it shows a dialog and no notebook (the
# notebook could not be opened).
RENDERED = """cells => {
    if (document.querySelector('.jp-Dialog') && !document.querySelector('.jp-NotebookPanel')) return true;
    if (document.querySelectorAll('.jp-NotebookPanel').length !== 1) return false;
    const rendered = [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown')]
        .filter(node => node.childElementCount > 0);
    const images = [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown img')];
    const addresses = [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown a')]
        .map(a => a.getAttribute('href') || '').concat(images.map(i => i.getAttribute('src') || ''));
    const done = rendered.length >= cells && images.every(i => i.complete)
        && addresses.every(address => address === '' || /^([a-z][a-z0-9+.-]*:|[#/])/i.test(address));
    return done;
}"""
# What a reader sees: each image (its src as written and as resolved, its width once loaded), each
# link (its href as written and as resolved), and a dialog's text when there is no notebook
SHOWN = """() => ({
    images: [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown img')]
        .map(i => [i.getAttribute('src'), i.src, i.naturalWidth]),
    links: [...document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown a[href]')]
        .map(a => [a.getAttribute('href'), a.href]),
    notebook: document.querySelector('.jp-NotebookPanel') !== null,
    title: document.querySelector('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel')
        ?.innerText || '',
    dialog: document.querySelector('.jp-Dialog')?.innerText || '',
})"""


def check_lesson(lab, name, images, links, shown):
    """What is wrong with a lesson as shown: (a) an image missing or not loaded, (b) a relative
    link or image that does not lead to a file the server serves."""
    problems = []

    def served(kind, pairs):  # the server's files that the page's images or links point to
        paths = []
        for written, address in pairs:
            url = urllib.parse.urlsplit(address)
            if written.startswith("#") or url.netloc != urllib.parse.urlsplit(lab.url).netloc:
                continue  # a heading of this page, or another site
            if url.path.startswith("/files/"):
                paths.append(urllib.parse.unquote(url.path[len("/files/"):]))
            else:
                problems.append(f"{name}: {kind} {written!r} points to {address}, not to a file")
        return sorted(paths)

    if len(shown["images"]) != len(images):
        problems.append(f"{name}: {len(shown['images'])} images shown, {len(images)} in its Markdown")
    problems += [f"{name}: image {src} did not load" for _, src, width in shown["images"] if width == 0]
    for kind, targets, pairs in [("image", images, [i[:2] for i in shown["images"]]),
                                 ("link", links, shown["links"])]:
        if (paths := served(kind, pairs)) != relative(targets):
            problems.append(f"{name}: {kind}s shown to {paths}, its Markdown has {relative(targets)}")
    for path in sorted(set(relative(images + links))):
        status, _ = lab.request(f"files/{urllib.parse.quote(path)}", method="HEAD")
        if status != 200:
            problems.append(f"{name}: {path} (from its Markdown): HTTP {status}")
    return problems


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make setup installs it as root)")
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                    reason="playwright is not installed (make setup installs it)")
@pytest.mark.timeout(150)
def test_lessons_in_a_browser_show_their_figures_and_links(lab):
    """JupyterLab opened once, at notebooks/, as `make lab` opens it; each lesson opened from its
    file browser with a double click, as a reader opens it, checked, and closed."""
    from playwright.sync_api import TimeoutError as PageTimeout
    from playwright.sync_api import sync_playwright

    problems, images_seen, links_seen = [], 0, 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            # ?reset: a fresh workspace, nothing open but the file browser at notebooks/
            page.goto(f"{lab.url}/lab/tree/notebooks?reset&token={lab.token}")
            listing = page.locator(".jp-DirListing-content")
            for notebook in LESSONS:
                cells, images, links = markdown_targets(notebook)
                name = re.compile(f"^{re.escape(notebook.name)}$")
                entry = listing.locator(".jp-DirListing-item").filter(
                    has=page.locator(".jp-DirListing-itemText", has_text=name))
                try:
                    entry.dblclick()
                    # its kernel starts meanwhile (unused); a dialog would not hide the cells' HTML
                    page.wait_for_function(RENDERED, arg=cells, polling=200)
                    shown = page.evaluate(SHOWN)
                except PageTimeout:
                    pytest.fail(f"{notebook.name}: not opened from the file browser, its Markdown not "
                                f"rendered, or its images not loaded, in 30 s")
                assert shown["notebook"], f"{notebook.name} not opened: {shown['dialog']!r}"
                assert shown["title"] == notebook.name, (shown["title"], notebook.name)
                problems += check_lesson(lab, notebook.name, images, links, shown)
                images_seen += len(shown["images"])
                links_seen += len(relative(links))  # all shown as served, unless a problem says not
                # Closed without saving: JupyterLab marks a notebook changed once its kernel's
                # metadata is filled in, and asks; the repository's file stays as it is.
                page.locator(f"{CURRENT_TAB} .lm-TabBar-tabCloseIcon").click()
                page.wait_for_function("() => document.querySelector('.jp-NotebookPanel') === null "
                                       "|| document.querySelector('.jp-Dialog') !== null")
                if page.locator(".jp-Dialog").count():
                    page.locator(".jp-Dialog").get_by_role("button", name="Discard").click()
                page.wait_for_function("() => document.querySelector('.jp-NotebookPanel') === null")
                for session in lab.api("sessions"):  # the kernel started for this lesson
                    lab.request(f"api/sessions/{session['id']}", method="DELETE")
        finally:
            browser.close()
    assert not problems, "\n".join(problems)
    assert images_seen >= 2 and links_seen > 0, (images_seen, links_seen)
