#!/usr/bin/env bash
# The wheel stands alone: builds it with `python -m build`, installs it (torch pinned to the CPU build)
# into a new venv in a temporary directory away from the repository, and runs `trainguard demo --quick`
# there; passes when the drill prints "drill passed". Used by `make test-wheel`.
#   scripts/wheel_check.sh [--keep]    # --keep leaves the temporary directory for a look
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TRAINGUARD_TORCH_PIN:-torch==2.13.0}
keep=0
for flag in "$@"; do
    case "$flag" in
        --keep) keep=1 ;;
        *) echo "wheel_check.sh: unknown option $flag" >&2; exit 2 ;;
    esac
done

bash scripts/bootstrap.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/trainguard-wheel.XXXXXX")
if [ "$keep" -eq 0 ]; then trap 'rm -rf "$work"' EXIT; else echo "wheel_check: keeping $work"; fi

echo "wheel_check: building the wheel"
.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { trap - EXIT; tail -20 "$work/build.log" >&2; echo "wheel_check: the build failed ($work/build.log)" >&2; exit 1; }
wheel=$(ls "$work"/dist/trainguard-*.whl)
echo "wheel_check: built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

echo "wheel_check: installing it alone into a new venv in $work"
"$PYTHON" -m venv "$work/venv"
# torch first and pinned: resolving the wheel's torch>= range alone could pull a multi-GB CUDA build
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" "$wheel"

# Run from a directory with no repository around it, with nothing of the repository on the path.
mkdir "$work/elsewhere"
cd "$work/elsewhere"
unset PYTHONPATH
installed=$("$work/venv/bin/python" -c "import trainguard; print(trainguard.__file__)")
case "$installed" in
    "$work/venv/"*) ;;
    *) trap - EXIT; echo "wheel_check: trainguard imported from $installed, not from the new venv ($work)" >&2; exit 1 ;;
esac
echo "wheel_check: trainguard demo --quick (trainguard from $installed)"
start=$(date +%s)
set +e
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$work/venv/bin/trainguard" demo --quick --out "$work/elsewhere/demo" 2>&1 \
    | tee "$work/demo.log"
code=${PIPESTATUS[0]}
set -e
if [ "$code" -eq 0 ] && grep -q "drill passed" "$work/demo.log"; then
    echo "wheel_check: passed: the wheel alone ran the drill to 'drill passed' in $(( $(date +%s) - start )) s"
else
    trap - EXIT  # kept for a look
    echo "wheel_check: FAILED: trainguard demo --quick exited $code (log: $work/demo.log)" >&2
    exit 1
fi
