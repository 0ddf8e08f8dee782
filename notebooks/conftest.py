"""Under pytest (nbmake), the notebooks run in smoke mode, their scripts forked from a preloaded
Python: the same session as the tests' (tests/helpers.py, course_session), and their kernels listen
on Unix sockets (kernels_on_unix_sockets says why). Here, so that it holds also when pytest is given
notebooks only (`pytest notebooks/02_ddp_cpu_gloo.ipynb`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import course_session, kernels_on_unix_sockets, start_preloaded  # noqa: E402

course_session()


def pytest_configure(config):
    kernels_on_unix_sockets()


def pytest_sessionstart(session):
    start_preloaded()
