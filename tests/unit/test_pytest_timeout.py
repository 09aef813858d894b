"""A hung test fails with the stack where it waits instead of holding the suite (and CI) for ever.

A pytest run in a subprocess, with this repository's configuration, on a file of two tests: one
passes, one sleeps past its ``@pytest.mark.timeout(2)`` (the per-test override of the default
``timeout`` of pyproject.toml).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = '''
import time

import pytest


def wait_for_a_reply_that_never_comes():
    time.sleep(120)


def test_quick():
    pass


@pytest.mark.timeout(2)
def test_hangs():
    wait_for_a_reply_that_never_comes()
'''


def test_a_hung_test_fails_with_its_stack_and_the_others_still_run(tmp_path):
    (tmp_path / "test_hang.py").write_text(TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "timeout: 600.0s" in out  # the default the repository configures
    assert "Timeout (>2.0s)" in out and "wait_for_a_reply_that_never_comes" in out and "time.sleep(120)" in out, out
    assert "1 failed, 1 passed" in out, out
