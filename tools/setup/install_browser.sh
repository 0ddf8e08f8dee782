#!/usr/bin/env bash
# The browser for tests/e2e/test_lab.py's check of the lessons as JupyterLab shows them: Debian's
# chromium, driven by Playwright (requirements-dev.txt). Installed where apt-get is usable as root
# (as in CI); elsewhere that test is skipped. Never fails.
set -u
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium (for the JupyterLab test) ..."
    if ! apt-get install -y -qq chromium >/dev/null 2>&1; then
        apt-get update -qq >/dev/null 2>&1
        apt-get install -y -qq chromium >/dev/null 2>&1 \
            || echo "note: could not install chromium; tests/e2e/test_lab.py's browser test will be skipped"
    fi
else
    echo "note: chromium is absent (not root or no apt-get); tests/e2e/test_lab.py's browser test will be skipped"
fi
exit 0
