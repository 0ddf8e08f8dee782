"""Under pytest (nbmake), the notebooks run in smoke mode: tiny runs (COURSE_SMOKE=0 for the full
ones; the kernels inherit this environment), their scripts forked from a Python with torch imported
already (tests/launcher.py; COURSE_PRELOADED=0 starts each in a new interpreter). Here, so that it
holds also when pytest is given notebooks only (`pytest notebooks/02_ddp_cpu_gloo.ipynb`)."""
import os
import sys
from pathlib import Path

os.environ.setdefault("COURSE_SMOKE", "1")
os.environ.setdefault("COURSE_PRELOADED", "1")


def pytest_sessionstart(session):
    """One preloaded Python for the whole session (tests/conftest.py asks for the same one)."""
    if os.environ.get("COURSE_PRELOADED") == "1":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import PRELOADED

        os.environ["COURSE_LAUNCHER"] = PRELOADED.ensure_started()
