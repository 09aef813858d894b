"""The lifeline of a rank on another node (``live/lifeline.py``), with real processes: the launcher's
SIGKILL reaches only the node command's local process, and the rank behind it ends through its stdin."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainguard.live import lifeline

RANK = "import sys, time; from trainguard.live.lifeline import hold; hold(18); print('ready', flush=True); time.sleep(60)"


def _gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text().replace(")", " ", 1):
            return True
        time.sleep(0.02)
    return False


def test_a_kill_ends_the_rank_behind_a_node_command_that_does_not_pass_signals_on(tmp_path):
    """The node command is a shell that runs the rank as its child (as ``unshare --fork`` or ``ssh`` do): its
    SIGKILL leaves the rank running; the lifeline's byte ends it (with the byte left out, the rank ran on)."""
    script = tmp_path / "rank.py"
    script.write_text(f"import os; open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n{RANK}\n")
    # the shell sleeps on after its rank: a rank ended by the byte must not let the shell exit 0 before its SIGKILL
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} {script}; sleep 60"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    rank = int((tmp_path / "pid").read_text())
    assert rank != proc.pid
    lifeline.kill(proc)
    assert proc.wait() == -9
    assert _gone(rank)


def test_the_lifelines_end_is_the_launchers_death_exit_18_with_one_line():
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.stdin.close()  # the launcher died: its end of the pipe closed
    assert proc.wait(timeout=20) == 18
    assert proc.stderr.read() == (f"live recovery: the launcher's lifeline (stdin) of rank process {proc.pid} ended; "
                                  "exiting 18: the run restarts from its newest durable checkpoint\n")


def test_a_process_without_a_lifeline_is_sigkilled():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lifeline.kill(proc)
    assert proc.wait(timeout=20) == -9
