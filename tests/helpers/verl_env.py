"""verl (its CPU-usable part) for interoperability tests: installed once with pip, without its GPU
dependencies, into a cached directory that goes first on ``PYTHONPATH``; verl's own tools are then run
in a subprocess with it. Tests that need it skip, naming the reason, when pip cannot install it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

VERL_VERSION = "0.9.1"
# verl itself plus what its imports of ``verl.model_merger`` and ``verl.utils.checkpoint`` reach that
# the project's environment lacks (torch, transformers, accelerate, numpy... come from the environment;
# --no-deps keeps pip from replacing them).
PACKAGES = (f"verl=={VERL_VERSION}", "ray", "tensordict==0.10.0", "codetiming", "hydra-core", "omegaconf==2.3.1",
            "antlr4-python3-runtime==4.9.3", "msgpack", "pyvers", "cloudpickle", "peft", "datasets", "pyarrow",
            "pandas", "dill", "multiprocess", "pytz", "tzdata", "orjson")
CACHE = Path(tempfile.gettempdir()) / f"trainguard-test-verl-{VERL_VERSION}-2"  # -2: the package list above
_READY = ".installed"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


@functools.cache  # installed and checked once per session (a skip raises, and is not cached)
def verl_pythonpath() -> str:
    """``PYTHONPATH`` for a subprocess that imports verl (installing it at the first call); skips the
    calling test with the reason when verl cannot be installed or imported here."""
    if not (CACHE / _READY).is_file():
        staging = CACHE.with_name(f"{CACHE.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
                                 str(staging), *PACKAGES], capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(f"verl {VERL_VERSION} cannot be installed with pip here: {_last_line(result.stderr)}")
        (staging / _READY).write_text(" ".join(PACKAGES) + "\n")
        shutil.rmtree(CACHE, ignore_errors=True)
        os.replace(staging, CACHE)
    source = str(Path(__file__).resolve().parents[2] / "src")
    path = os.pathsep.join([str(CACHE), source])
    check = subprocess.run([sys.executable, "-c", "import verl.model_merger.fsdp_model_merger"],
                           env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        pytest.skip(f"verl {VERL_VERSION} is installed in {CACHE} but does not import: {_last_line(check.stderr)}")
    return path


def run_in_verl(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs Python ``code`` (with ``args`` in ``sys.argv[1:]``) where verl imports."""
    env = {**os.environ, "PYTHONPATH": verl_pythonpath(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


# verl's own command line (``python -m verl.model_merger merge --backend fsdp ...``), once per
# LOCAL_DIR TARGET_DIR pair, in one process: verl and its imports load once.
VERL_MERGE = """
import sys
from verl.model_merger.__main__ import main
pairs = sys.argv[1:]
for local_dir, target_dir in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", local_dir, "--target_dir", target_dir]
    main()
"""
