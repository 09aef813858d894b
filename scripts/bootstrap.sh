#!/usr/bin/env bash
# Creates or reuses .venv and installs trainguard with its test extras.
# The CPU build of torch is installed first, pinned: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TRAINGUARD_TORCH_PIN:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_PIN"
fi
stamp=.venv/.trainguard-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
    touch "$stamp"
fi
# The report test renders report.html in headless Chromium (Debian's chromium package): tests only.
if [ "${1:-}" = "--with-browser" ] && ! command -v chromium >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium
fi
