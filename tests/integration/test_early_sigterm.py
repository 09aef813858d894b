"""SIGTERM to ``trainguard train`` in its first seconds, while it still imports torch, before the supervisor
(or the live path) installs its own handler: the documented stop before anything started, ``trainguard:
received SIGTERM: starting no ranks, exit 16``, not the default action's exit 143 (``runtime.early_signals``).

The signal is sent, for real, at the first of: the command catches SIGTERM (its ``SigCgt`` mask in
/proc) or torch's library is mapped into it (its imports are under way). Held from the start, the
command catches it first; without the hold, torch loads long before the supervisor's handler is there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.runs import TINY, worker_env
from trainguard.errors import EXIT_RESUMABLE_STOP


def catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        mask = next(line.split()[1] for line in status if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def imports_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


@pytest.mark.parametrize("mode", [[], ["--set", "fault_tolerance.live=true", "--set", "parallel.dp_replicate=2",
                                       "--set", "train.micro_batches=2"]], ids=["supervised", "live"])
def test_a_sigterm_while_the_command_starts_stops_it_before_anything_starts(mode, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "train", "--nproc", "2", "--steps", "2",
                             "--run-dir", str(run_dir), *TINY, *mode], env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (catches_sigterm(proc.pid) or imports_torch(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "the command ended or hung while starting"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_RESUMABLE_STOP, stdout[-2000:] + stderr[-2000:]
    assert f"received SIGTERM: starting no ranks, exit {EXIT_RESUMABLE_STOP}" in stdout + stderr
    assert "Traceback" not in stderr
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
