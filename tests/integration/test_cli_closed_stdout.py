"""A command whose reader leaves (``trainguard plan --json | head -1``) ends quietly: no traceback, exit 141
(the shell's code for a writer ended by SIGPIPE), through ``cli.main`` for ``print`` and through
``cli.output.stdout_console`` for rich's tables (whose own answer is exit 1).

Each command runs through the installed entry point with its stdout the write end of a real pipe whose
read end is already closed, so every write fails with EPIPE, whatever the output's size and timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import worker_env
from trainguard.errors import EXIT_CLOSED_STDOUT

ENTRY_POINT = Path(sys.executable).with_name("trainguard")


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([str(ENTRY_POINT), *args], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              env=worker_env(), timeout=120)
    finally:
        os.close(write_end)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as ``status`` and ``ckpt list`` read it: one event, an empty checkpoints/."""
    run_dir = tmp_path_factory.mktemp("closed_stdout")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "events.jsonl").write_text('{"time": 1.0, "kind": "run_started", "step": 0, "rank": 0}\n')
    return run_dir


@pytest.mark.parametrize("command", [["plan", "--params", "7e9", "--json"], ["plan", "--params", "7e9"],
                                     ["status", "RUN_DIR"], ["ckpt", "list", "RUN_DIR"]],
                         ids=["plan-json", "plan-table", "status", "ckpt-list"])
def test_a_closed_stdout_ends_the_command_quietly_with_the_shells_code(command, run_dir):
    done = run_into_closed_pipe(*[str(run_dir) if arg == "RUN_DIR" else arg for arg in command])
    assert done.returncode == EXIT_CLOSED_STDOUT, done.stderr[-2000:]
    assert done.stderr == ""
