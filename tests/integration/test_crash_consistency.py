"""A crash at any instant during save or commit leaves a committed checkpoint that verifies."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from helpers.runs import TINY, events, ok, train, trainguard, worker_env
from helpers.warm_command import warm_server

STEPS = 30
SAVE = ["--save-interval", "2"]


def _killed_externally(run_dir, delay: float) -> None:
    """Starts a run, waits for its first commit, then SIGKILLs every process ``delay`` seconds later."""
    proc = warm_server().start(["train", "--nproc", "2", "--steps", str(STEPS), "--run-dir", str(run_dir), *SAVE, *TINY],
                               worker_env())  # a session of its own, as train() starts it
    deadline = time.monotonic() + 120
    while not events(run_dir, "checkpoint_committed") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _trial(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / f"trial{seed}"
    if seed % 2 == 0:
        # the kill lands while the previous step's async save is being written or committed
        step = rng.choice(range(3, STEPS + 1, 2))
        proc = train(run_dir, 2, STEPS, *SAVE, faults=f"kill:rank={rng.randrange(2)},step={step}")
        assert proc.returncode != 0
    else:
        _killed_externally(run_dir, delay=rng.uniform(0.0, 1.5))

    ok(train(run_dir, 2, STEPS, *SAVE, "--resume", "auto"))
    finished = events(run_dir, "run_finished")
    assert finished and finished[-1]["step"] == STEPS
    verify = trainguard("ckpt", "verify", str(run_dir))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    resumed_from = events(run_dir, "run_started")[-1]["resumed_from"]
    if resumed_from is not None:
        assert "global_step_" in resumed_from and ".tmp" not in resumed_from
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if ".tmp" in p.name or p.name.startswith(".trash")]
    assert not leftovers


@pytest.mark.parametrize("seed", range(3))  # both kill modes (even: fault, odd: external); more in _many
def test_crash_during_save_and_commit(tmp_path, seed):
    _trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 130))
def test_crash_during_save_and_commit_many(tmp_path, seed):
    _trial(tmp_path, seed)


def test_kill_fault_fires_once_per_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_dir, 2, 6, *SAVE, faults="kill:rank=1,step=5")
    assert first.returncode != 0
    injected = events(run_dir, "fault_injected")
    assert [(e["fault"], e["step"], e["rank"]) for e in injected] == [("kill", 5, 1)]
    # the same spec on restart must not fire again: the run finishes
    ok(train(run_dir, 2, 6, *SAVE, faults="kill:rank=1,step=5"))
    assert len(events(run_dir, "fault_injected")) == 1
    # the save of step 2 was committed before the save of step 4 began; step 4's may have been cut off
    assert events(run_dir, "run_started")[-1]["resumed_from"].rsplit("_", 1)[1] in ("2", "4")
