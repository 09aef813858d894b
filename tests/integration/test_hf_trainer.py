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
from helpers.runs import assert_same_tensors, events, finish_session, launched_fixture, succeeded, worker_env

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


def fine_tune(run_dir: Path, *extra: str, steps: int = STEPS, faults: str = "") -> subprocess.CompletedProcess:
    run_dir.mkdir()
    return run(example_command(run_dir, steps, *extra), faults=faults)


def killed_after_the_save_of_step_50(run_dir: Path) -> subprocess.CompletedProcess:
    run_dir.mkdir()
    return run_killed_after_the_save_of_step_50(run_dir, STEPS)


def sigterm_after_5_steps(run_dir: Path) -> subprocess.CompletedProcess:
    """A fine-tune of 2000 steps sent SIGTERM once its log holds 5 entries (torchrun passes it to the ranks)."""
    run_dir.mkdir()
    proc = subprocess.Popen(example_command(run_dir, 2000), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=worker_env(), start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    while not (run_dir / "logs.jsonl").is_file() or len(logs(run_dir)) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "the fine-tune ended before its 5th step"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to the ranks
    return finish_session(proc, TIMEOUT_S, "the stopped fine-tune")


def counting_runs(run_dir: Path) -> list[subprocess.CompletedProcess]:
    """hf_counting_run.py stopped at step 30 by ``train.exit_at_step``, then started again to step 40."""
    return [subprocess.run([sys.executable, str(COUNTING_RUN), str(run_dir), "40", *overrides], capture_output=True,
                           text=True, env=worker_env(), timeout=TIMEOUT_S)
            for overrides in (("train.exit_at_step=30",), ())]


def flipped_at_rest(run_dir: Path) -> subprocess.CompletedProcess:
    """A bit of rank 1's weights flipped at rest before step 60, under the supervisor."""
    run_dir.mkdir()
    command = [sys.executable, "-m", "trainguard", "run", "--max-restarts", "3", "--",
               *example_command(run_dir, STEPS, "--set", "guards.fingerprint.interval=10")]
    return run(command, faults="stateflip:rank=1,step=60,site=model.layers.0.mlp.down_proj.weight,"
                               "state=weight,index=3,bit=27")


RUNS = {  # name: the launches of one test, in a directory of their own named after it; the longest first
    "flipped": flipped_at_rest,
    "killed": killed_after_the_save_of_step_50,
    "straight": fine_tune,
    "plain": lambda run_dir: fine_tune(run_dir, "--plain"),
    "stopped": sigterm_after_5_steps,
    "counting": counting_runs,
    # data skip is off by default: this run is about that setting
    "spiked": lambda run_dir: fine_tune(run_dir, "--set", "guards.skip.enabled=true", "--set",
                                        "guards.skip.threshold=50", steps=6, faults="spike:step=3"),
}
launched = launched_fixture("hf_trainer", RUNS)  # two at a time (helpers/runs.py's launch_together)


@pytest.fixture(scope="module")
def plain(launched) -> list[dict]:
    return logs(succeeded(launched["plain"]))


@pytest.fixture(scope="module")
def straight(launched) -> Path:
    return succeeded(launched["straight"])


def test_logged_metrics_equal_a_plain_trainers(straight, plain):
    guarded = logs(straight)
    assert sorted(step_logs(guarded)) == list(range(1, STEPS + 1))
    assert_logged_as_plain(step_logs(guarded), step_logs(plain))
    assert guarded[0]["loss"] == plain[0]["loss"]  # bitwise, before any clipping
    assert guarded[-1]["train_loss"] == pytest.approx(plain[-1]["train_loss"], rel=RTOL)
    assert guarded[-1]["epoch"] == plain[-1]["epoch"]
    assert sorted(p.name for p in (straight / "checkpoints").glob("global_step_*")) == ["global_step_50",
                                                                                       f"global_step_{STEPS}"]


def test_sigkilled_fine_tune_under_the_supervisor_resumes_bitwise(straight, plain, launched):
    """As docs/library.md runs it: ``trainguard run --max-restarts 3 -- torchrun ... examples/hf_trainer.py``."""
    run_dir, proc = launched["killed"].result()
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed = assert_resumed_from_50_bitwise(straight, run_dir, STEPS)
    assert_logged_as_plain(step_logs(resumed), step_logs(plain))
    # as a plain Trainer resumed from a checkpoint: the mean over the steps of this call
    losses = [e["loss"] for e in resumed if "loss" in e]
    assert resumed[-1]["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert resumed[-1]["epoch"] == plain[-1]["epoch"]


def test_sigterm_stops_after_a_saved_step_with_no_phantom_step(launched):
    run_dir, _ = launched["stopped"].result()
    (stop,) = events(run_dir, "lifecycle_stop")
    assert stop["exit_code"] == 16 and stop["last_checkpoint"] == stop["step"]
    entries = step_logs(logs(run_dir))
    assert sorted(entries) == list(range(1, stop["step"] + 1))
    assert all(entry["loss"] > 1.0 for entry in entries.values())
    assert (run_dir / "checkpoints" / f"global_step_{stop['step']}").is_dir()


def test_spike_is_skipped_by_the_guard_and_flagged_in_the_log(launched):
    """Data skip is off by default: this test is about that setting."""
    run_dir, proc = launched["spiked"].result()
    assert proc.returncode == 0, proc.stdout[-4000:]
    (skip,) = events(run_dir, "data_skip")
    assert skip["step"] == 3 and skip["global_norm"] > 50
    entries = step_logs(logs(run_dir))
    assert entries[3]["skipped"] == 1 and entries[3]["grad_norm"] == pytest.approx(skip["global_norm"], rel=RTOL)
    assert all("skipped" not in entries[step] for step in (1, 2, 4, 5, 6))
    assert (run_dir / "checkpoints" / "global_step_6" / "huggingface" / "config.json").is_file()


def test_resume_skips_the_trained_batches_without_loading_them(launched):
    """One process (per_device_train_batch_size 2): stopped at step 30 by ``train.exit_at_step``, the
    second start trains steps 31-40 and loads their 20 samples only, not the 60 already trained on
    (each start also loads the 2 samples of one batch ahead: accelerate's loader draws one batch early
    to know the last one)."""
    run_dir, procs = launched["counting"].result()
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stopped, resumed = (json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs)
    assert stopped == {"loads": 60 + 2, "exit_code": 0}
    assert resumed == {"loads": 20 + 2, "exit_code": 0}
    (started,) = [e for e in events(run_dir, "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_30")


def test_state_changed_at_rest_restarts_from_the_restored_checkpoint(straight, launched):
    """A bit of rank 1's weights flipped at rest before step 60 (the fingerprint check every 10 steps):
    the guard restores global_step_50, which the Trainer cannot rewind to in place; the process ends
    saying so, and the supervisor's restart recomputes from there, ending bitwise as the straight run."""
    run_dir, proc = launched["flipped"].result()
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "GuardedTrainer: the guard restored global_step_50 (state that changed at rest" in proc.stdout
    (recompute,) = events(run_dir, "fingerprint_recompute")
    assert recompute["step"] == 60 and recompute["to_step"] == 50
    (started,) = [e for e in events(run_dir, "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_50")
    final = f"global_step_{STEPS}"
    assert assert_same_tensors(straight / "checkpoints" / final, run_dir / "checkpoints" / final) > 0
