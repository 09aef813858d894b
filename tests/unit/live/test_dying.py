"""``live.dying.killed_by`` on real processes: a SIGKILLed process reads as killed by SIGKILL before anyone
reaps it, a running, stopped or self-exiting one never does, a gone one reads as nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainguard.live.dying import killed_by


def _settle(pid: int, until, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = killed_by(pid)
        if until(seen):
            return seen
        time.sleep(0.001)
    return killed_by(pid)


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        line = stat.read()
    return line[line.rfind(b")") + 2:].split()[0]


def test_a_killed_process_reads_as_killed_by_its_signal_before_it_is_reaped():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert killed_by(process.pid) is None  # running
        os.kill(process.pid, signal.SIGKILL)
        assert _settle(process.pid, lambda seen: seen is not None) == signal.SIGKILL
        assert process.returncode is None  # seen without a wait: nobody reaped it
    finally:
        process.kill()
        assert process.wait() == -signal.SIGKILL
    assert killed_by(process.pid) is None  # reaped: gone


def test_a_stopped_process_and_one_that_exits_by_itself_never_read_as_killed():
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exiting = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while _state(stopped.pid) != b"T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(stopped.pid) == b"T"
        assert killed_by(stopped.pid) is None
        deadline = time.monotonic() + 30
        while _state(exiting.pid) != b"Z" and time.monotonic() < deadline:
            assert killed_by(exiting.pid) is None
            time.sleep(0.001)
        assert _state(exiting.pid) == b"Z"  # exited, not reaped: its exit code 3 is not a signal
        assert killed_by(exiting.pid) is None
    finally:
        stopped.kill()
        stopped.wait()
        assert exiting.wait() == 3
