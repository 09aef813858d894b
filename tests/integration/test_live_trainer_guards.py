"""Issue 35's must-show run: ``trainguard train --nproc 4`` in live mode with ``parallel.dp_replicate=2``,
``parallel.dp_shard=2``, durable checkpoints every 5 steps, data skip (``guards.skip.enabled``) and SDC
detection at level 2 (``guards.sdc.enabled_level``) on (llama-micro, AdamW with warmup and cosine, 12
steps of 4 micro-batches):

- fault-free: ``global_step_5``, ``_10`` and ``_12`` committed; the guards ran (the data skip's line every
  step, the SDC points announced) and judged nothing abnormal;
- rank 3 SIGKILLed by the live drill as it starts step 6: ranks 0-2 keep their processes (one
  ``live_start`` pid each), rank 3 is replaced, and the final durable checkpoint holds bitwise the
  fault-free run's tensors (as does every rank's final state);
- the whole job SIGKILLed (launcher and ranks) after ``global_step_5`` was committed, then the same command
  with ``--resume auto``: it resumes from ``global_step_5`` and ends bitwise equal too.

- each rank holds half of its replica group's parameters (``dp_shard`` 2: ``live/sharded_params.py``),
  asserted from the local shard sizes of every rank's final state in each run (the replacement's too).

The runs are module fixtures (``clean``, ``killed_rank``, ``killed_job``) so that a further assertion on
the same runs costs no run of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.runs import events as events_of, finish_session, worker_env
from helpers.sharded_state import assert_each_rank_holds_its_share
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.live.compare import bitwise_differences, run_differences
from trainguard.live.files import events_path

STEPS, WORLD, INTERVAL, KILL_AT, JOB_KILLED_AFTER = 12, 4, 5, 6, 7
GROUP = 2  # parallel.dp_shard: the ranks of a replica group, which shard its parameters
TIMEOUT_S = 300
TRAIN = ["--nproc", str(WORLD), "--steps", str(STEPS), "--save-interval", str(INTERVAL),
         *[arg for item in ("fault_tolerance.live=true", "parallel.dp_replicate=2", f"parallel.dp_shard={GROUP}",
                            "guards.skip.enabled=true", "guards.sdc.enabled_level=2", "model.preset=llama-micro",
                            "data.seq_len=32", "train.micro_batches=4", "data.micro_batch_size=2")
           for arg in ("--set", item)]]


def _start(run_dir: Path, *extra: str):
    """``trainguard train`` in a session of its own (its pid is the launcher's, its process group the job's)."""
    return warm_server().start(["train", "--run-dir", str(run_dir), *TRAIN, *extra], worker_env())


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _committed_steps(run_dir: Path) -> list[int]:
    return [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed]


def _final_checkpoint(run_dir: Path) -> dict:
    return read_full_state_dict(run_dir / "checkpoints" / f"global_step_{STEPS}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_trainer_guards")


@pytest.fixture(scope="module")
def clean(root):
    run_dir = root / "clean"
    return run_dir, _ok(finish_session(_start(run_dir), TIMEOUT_S, "the fault-free trainer run"))


@pytest.fixture(scope="module")
def killed_rank(root):
    run_dir = root / "killed_rank"
    done = finish_session(_start(run_dir, "--set", f"faults=kill:rank=3,step={KILL_AT}"), TIMEOUT_S,
                          "the trainer run with rank 3 killed")
    return run_dir, _ok(done)


@pytest.fixture(scope="module")
def killed_job(root):
    run_dir = root / "killed_job"
    proc = _start(run_dir)
    deadline = time.monotonic() + TIMEOUT_S
    # live_step counts from 0: step index 6 committed is the closure mode's step 7, after global_step_5, whose
    # async save commits in the background while the next steps run: committed too
    while not (events_path(run_dir).exists()
               and any(e["step"] + 1 >= JOB_KILLED_AFTER for e in events_of(run_dir, "live_step"))
               and INTERVAL in _committed_steps(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 7"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    newest = _committed_steps(run_dir)[-1]
    again = finish_session(_start(run_dir, "--resume", "auto"), TIMEOUT_S, "the resumed trainer run")
    return run_dir, newest, _ok(again)


def test_the_fault_free_run_saves_every_5_steps_and_runs_data_skip_and_sdc(clean):
    run_dir, done = clean
    assert _committed_steps(run_dir) == [INTERVAL, 2 * INTERVAL, STEPS]
    assert f"opt_global_step: {STEPS - 1}, skip_data_grad_norm_threshold:" in done.stdout  # data skip judged
    [points] = events_of(run_dir, "sdc_points")
    assert "model.norm" in points["names"] and points["count"] > 10
    assert not events_of(run_dir, "sdc_detected") and not events_of(run_dir, "data_skip")


def test_a_sigkilled_rank_is_recovered_live_and_the_final_checkpoint_is_bitwise_the_fault_free_one(clean,
                                                                                                  killed_rank):
    run_dir, done = killed_rank
    assert "ranks replaced: [3]" in done.stdout
    pids = {rank: [e["pid"] for e in events_of(run_dir, "live_start") if e["rank"] == rank] for rank in range(WORLD)}
    assert all(len(pids[rank]) == 1 for rank in range(3)), pids  # the survivors kept their processes
    assert len(pids[3]) == 2 and [e["pid"] for e in events_of(run_dir, "live_kill")] == [pids[3][0]]
    assert bitwise_differences(_final_checkpoint(run_dir), _final_checkpoint(clean[0])) == []
    assert run_differences(clean[0], run_dir, WORLD) == {}


def test_the_whole_job_sigkilled_then_resume_auto_ends_bitwise_equal(clean, killed_job):
    run_dir, newest, again = killed_job
    assert newest in (INTERVAL, 2 * INTERVAL)  # 10 when step 5's commit came late and step 10's before the kill
    assert f"live run resumes from {run_dir / 'checkpoints' / f'global_step_{newest}'}" in again.stdout
    assert bitwise_differences(_final_checkpoint(run_dir), _final_checkpoint(clean[0])) == []
    assert run_differences(clean[0], run_dir, WORLD) == {}


def test_each_rank_holds_half_of_its_groups_parameters(clean, killed_rank, killed_job):
    for run_dir in (clean[0], killed_rank[0], killed_job[0]):
        assert_each_rank_holds_its_share(run_dir, WORLD, GROUP)
