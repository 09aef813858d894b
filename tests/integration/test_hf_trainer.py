"""``GuardedTrainer`` (trainguard.integrations.hf_trainer) in examples/hf_trainer.py: a Hugging Face ``Trainer``
fine-tune of a tiny Qwen2 with DDP through accelerate, 2 gloo ranks under torchrun, with trainguard's
default config (async saves, every 50 steps). Its logs equal a plain ``Trainer``'s on the same steps;
SIGKILLed under the supervisor it resumes and ends bitwise equal to a run that never stopped, logging
what the plain Trainer logs; SIGTERM stops it after a saved step with no phantom step; a gradient spike
is skipped by the guard and flagged in the log; a resume skips the trained batches without loading them."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.hf_runs import (ROOT, TIMEOUT_S, assert_resumed_from_50_bitwise, example_command, logs, run,
                             run_killed_after_the_save_of_step_50, step_logs)
from helpers.runs import assert_same_tensors, events, finish_session, worker_env

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

COUNTING_RUN = ROOT / "tests" / "helpers" / "hf_counting_run.py"
STEPS = 60  # past the default save interval (50): a kill at step 55 resumes from global_step_50
# The guard measures the global norm in float64, torch's clip_grad_norm_ (the plain Trainer's) in float32:
# the norms differ in the 7th digit, and once clipping scales the gradients by them the losses drift in
# the 7th digit too (measured: at most 1.2e-7 relative over 60 steps; step 1's loss is bitwise equal).
RTOL = 1e-6


def assert_logged_as_plain(guarded: dict[int, dict], plain: dict[int, dict]) -> None:
    for step, entry in guarded.items():
        expected = plain[step]
        assert entry["learning_rate"] == expected["learning_rate"] and entry["epoch"] == expected["epoch"], step
        assert math.isclose(entry["loss"], expected["loss"], rel_tol=RTOL), (step, entry, expected)
        assert math.isclose(entry["grad_norm"], expected["grad_norm"], rel_tol=RTOL), (step, entry, expected)
        assert "skipped" not in entry


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("hf_trainer") / "plain"
    run_dir.mkdir()
    proc = run(example_command(run_dir, STEPS, "--plain"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return logs(run_dir)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf_trainer") / "straight"
    run_dir.mkdir()
    proc = run(example_command(run_dir, STEPS))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return run_dir


def test_logged_metrics_equal_a_plain_trainers(straight, plain):
    guarded = logs(straight)
    assert sorted(step_logs(guarded)) == list(range(1, STEPS + 1))
    assert_logged_as_plain(step_logs(guarded), step_logs(plain))
    assert guarded[0]["loss"] == plain[0]["loss"]  # bitwise, before any clipping
    assert guarded[-1]["train_loss"] == pytest.approx(plain[-1]["train_loss"], rel=RTOL)
    assert guarded[-1]["epoch"] == plain[-1]["epoch"]
    assert sorted(p.name for p in (straight / "checkpoints").glob("global_step_*")) == ["global_step_50",
                                                                                       f"global_step_{STEPS}"]


def test_sigkilled_fine_tune_under_the_supervisor_resumes_bitwise(straight, plain, tmp_path):
    """As docs/library.md runs it: ``trainguard run --max-restarts 3 -- torchrun ... examples/hf_trainer.py``."""
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    proc = run_killed_after_the_save_of_step_50(run_dir, STEPS)
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed = assert_resumed_from_50_bitwise(straight, run_dir, STEPS)
    assert_logged_as_plain(step_logs(resumed), step_logs(plain))
    # as a plain Trainer resumed from a checkpoint: the mean over the steps of this call
    losses = [e["loss"] for e in resumed if "loss" in e]
    assert resumed[-1]["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert resumed[-1]["epoch"] == plain[-1]["epoch"]


def test_sigterm_stops_after_a_saved_step_with_no_phantom_step(tmp_path):
    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    proc = subprocess.Popen(example_command(run_dir, 2000), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=worker_env(), start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    while not (run_dir / "logs.jsonl").is_file() or len(logs(run_dir)) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "the fine-tune ended before its 5th step"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to the ranks
    finish_session(proc, TIMEOUT_S, "the stopped fine-tune")
    (stop,) = events(run_dir, "lifecycle_stop")
    assert stop["exit_code"] == 16 and stop["last_checkpoint"] == stop["step"]
    entries = step_logs(logs(run_dir))
    assert sorted(entries) == list(range(1, stop["step"] + 1))
    assert all(entry["loss"] > 1.0 for entry in entries.values())
    assert (run_dir / "checkpoints" / f"global_step_{stop['step']}").is_dir()


def test_spike_is_skipped_by_the_guard_and_flagged_in_the_log(tmp_path):
    """Data skip is off by default: this test is about that setting."""
    run_dir = tmp_path / "spiked"
    run_dir.mkdir()
    proc = run(example_command(run_dir, 6, "--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=50"),
               faults="spike:step=3")
    assert proc.returncode == 0, proc.stdout[-4000:]
    (skip,) = events(run_dir, "data_skip")
    assert skip["step"] == 3 and skip["global_norm"] > 50
    entries = step_logs(logs(run_dir))
    assert entries[3]["skipped"] == 1 and entries[3]["grad_norm"] == pytest.approx(skip["global_norm"], rel=RTOL)
    assert all("skipped" not in entries[step] for step in (1, 2, 4, 5, 6))
    assert (run_dir / "checkpoints" / "global_step_6" / "huggingface" / "config.json").is_file()


def test_resume_skips_the_trained_batches_without_loading_them(tmp_path):
    """One process (per_device_train_batch_size 2): stopped at step 30 by ``train.exit_at_step``, the
    second start trains steps 31-40 and loads their 20 samples only, not the 60 already trained on
    (each start also loads the 2 samples of one batch ahead: accelerate's loader draws one batch early
    to know the last one)."""
    def counting_run(*overrides: str) -> dict:
        proc = subprocess.run([sys.executable, str(COUNTING_RUN), str(tmp_path / "run"), "40", *overrides],
                              capture_output=True, text=True, env=worker_env(), timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert counting_run("train.exit_at_step=30") == {"loads": 60 + 2, "exit_code": 0}
    assert counting_run() == {"loads": 20 + 2, "exit_code": 0}
    (started,) = [e for e in events(tmp_path / "run", "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_30")


def test_state_changed_at_rest_restarts_from_the_restored_checkpoint(straight, tmp_path):
    """A bit of rank 1's weights flipped at rest before step 60 (the fingerprint check every 10 steps):
    the guard restores global_step_50, which the Trainer cannot rewind to in place; the process ends
    saying so, and the supervisor's restart recomputes from there, ending bitwise as the straight run."""
    run_dir = tmp_path / "flipped"
    run_dir.mkdir()
    command = [sys.executable, "-m", "trainguard", "run", "--max-restarts", "3", "--",
               *example_command(run_dir, STEPS, "--set", "guards.fingerprint.interval=10")]
    proc = run(command, faults="stateflip:rank=1,step=60,site=model.layers.0.mlp.down_proj.weight,"
                               "state=weight,index=3,bit=27")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "GuardedTrainer: the guard restored global_step_50 (state that changed at rest" in proc.stdout
    (recompute,) = events(run_dir, "fingerprint_recompute")
    assert recompute["step"] == 60 and recompute["to_step"] == 50
    (started,) = [e for e in events(run_dir, "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_50")
    final = f"global_step_{STEPS}"
    assert assert_same_tensors(straight / "checkpoints" / final, run_dir / "checkpoints" / final) > 0
