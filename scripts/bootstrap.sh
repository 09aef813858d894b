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
# Test-only system packages: headless Chromium renders report.html (--with-browser); a real Slurm
# (Debian's slurmctld, slurmd, slurm-client and munge; tests/integration/test_slurm.py starts its own
# daemons from a generated slurm.conf, nothing is configured system-wide) (--with-slurm).
packages=()
with_torchtitan=0
for flag in "$@"; do
    case "$flag" in
        --with-browser) command -v chromium >/dev/null 2>&1 || packages+=(chromium) ;;
        --with-slurm) [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
                          && command -v srun >/dev/null 2>&1 || packages+=(slurmctld slurmd slurm-client munge) ;;
        --with-torchtitan) with_torchtitan=1 ;;
        *) echo "bootstrap.sh: unknown option $flag" >&2; exit 2 ;;
    esac
done
if [ "${#packages[@]}" -gt 0 ]; then
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi
# torchtitan for tests/integration/test_torchtitan.py (--with-torchtitan), without its declared
# dependencies: they pin datasets<4.8, which pulls fsspec below what s3fs needs; the components the test
# imports need only these.
if [ "$with_torchtitan" -eq 1 ] && ! .venv/bin/python -c "import torchtitan, triton, tyro, spmd_types" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps torchtitan==0.3.0 \
        spmd_types==0.2.3 triton==3.9.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
fi
