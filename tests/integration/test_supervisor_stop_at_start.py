"""SIGTERM to ``trainguard train``/``run`` right after it started, while its ranks were still starting
(no heartbeat yet), once printed "received SIGTERM: asking every rank to save and stop" and then lost
the stop: the ranks trained to the end and the command exited 0 instead of saving and exiting 16
(found by sending SIGTERM to ``trainguard train --nproc 2 ...`` as soon as its events.jsonl appeared)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from helpers.runs import events, finish_session, worker_env
from helpers.warm_command import warm_server

SLOW_RANK = Path(__file__).resolve().parents[1] / "helpers" / "slow_start_rank.py"


def test_a_stop_received_before_the_ranks_beat_reaches_them_once_they_do(tmp_path):
    run, go = tmp_path / "run", tmp_path / "go"
    proc = warm_server().start(["run", "--run-dir", str(run), "--", sys.executable, str(SLOW_RANK), str(run), str(go)],
                               worker_env())
    deadline = time.monotonic() + 120
    while not events(run, "incarnation_started"):
        assert proc.poll() is None and time.monotonic() < deadline, "the supervisor did not start its agent"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the rank has no heartbeat yet: it waits for GO
    time.sleep(1.0)  # the supervisor's watch loop (0.1 s polls) has passed the stop on to nobody by now
    go.touch()
    done = finish_session(proc, 120, "trainguard run")
    assert "received SIGTERM: asking every rank to save and stop" in done.stdout + done.stderr
    assert done.returncode == 16, done.stdout[-3000:] + done.stderr[-3000:]
    assert events(run, "supervisor_finished")[-1]["exit_code"] == 16
