"""Data skip and checkpoint health in live multi-process runs of the reference trainer."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from helpers.runs import events, flat_state, launched_fixture, ok, succeeded, train

SKIP = ["--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=10.0"]
STREAK = ("--save-interval", "1", *SKIP, "--set", "guards.skip.count_threshold=3")
ADAPTIVE = ["--set", "guards.skip.enabled=true", "--set", "guards.skip.mode=adaptive"]
RUNS = {  # name: the runs of one test or fixture (a function of its directory), independent of the others
    "health": lambda run: train(run, 2, 8, "--save-interval", "2", "--set", "checkpoint.keep_last=10",
                                "--set", "guards.health.enabled=true", "--set", "guards.health.embedding_threshold=50.0",
                                "--set", "guards.local_norm=true",
                                faults="scale:rank=0,step=8,site=model.layers.0,where=grad_input,factor=1000"),
    "adaptive": lambda run: (train(run, 2, 30, *ADAPTIVE, "--save-interval", "30"),
                             train(run, 2, 50, *ADAPTIVE, "--save-interval", "0", "--set", "data.seq_len=4")),
    "streak": lambda run: (train(run, 2, 8, *STREAK, "--set", "train.exit_at_step=3", faults="spike:step=3,persistent=1"),
                           train(run, 2, 8, *STREAK, faults="spike:step=3,persistent=1")),
    "skip": lambda run: train(run, 2, 7, "--save-interval", "1", "--set", "checkpoint.keep_last=20", *SKIP,
                              "--set", "guards.skip.count_threshold=3", faults="spike:step=3;nan:step=5"),
    "abort": lambda run: train(run, 2, 8, "--save-interval", "0", *SKIP, "--set", "guards.skip.count_threshold=2",
                               faults="spike:step=3,persistent=1"),
}
launched = launched_fixture("guards", RUNS)  # two at a time (helpers/runs.py's launch_together)


@pytest.fixture(scope="module")
def skip_run(launched):
    run, proc = launched["skip"].result()
    return run, ok(proc).stdout


def _tensors(run, step):
    return {k: v for k, v in flat_state(run / f"checkpoints/global_step_{step}").items() if isinstance(v, torch.Tensor)}


def test_skipped_steps_leave_parameters_and_moments_bitwise_unchanged(skip_run):
    run, _ = skip_run
    for skipped in (3, 5):
        before, after = _tensors(run, skipped - 1), _tensors(run, skipped)
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), f"step {skipped} changed the state"
    applied_before, applied_after = _tensors(run, 3), _tensors(run, 4)
    assert any(not torch.equal(applied_before[k], applied_after[k]) for k in applied_before)


def test_reference_log_lines_and_counts(skip_run):
    run, out = skip_run
    assert "opt_global_step: 2, skip_data_grad_norm_threshold: 10.0, is_skip: [ True]" in out
    assert re.search(r"Current global norm \[\d+\.\d{6}\] of step 3 has been 1 consecutive times greater than "
                     r"threshold: 10\.0", out)
    assert "opt_global_step: 2, skip_data_grad_norm_threshold: 10.0, is_skip: [False]" in out  # step 4 resets
    assert re.search(r"Current global norm \[nan\] of step 5 has been 1 consecutive times", out)
    steps = {e["step"]: e for e in events(run, "step")}
    assert [s for s, e in steps.items() if e["skipped"]] == [3, 5]
    assert steps[7]["skipped_total"] == 2 and steps[7]["nan_total"] == 1
    assert "number of skipped iterations: 2, number of nan iterations: 1" in out
    assert steps[3]["lr"] == steps[4]["lr"]  # the LR schedule did not advance on the skipped step


def test_abort_after_consecutive_spikes_exits_3(launched):
    run, proc = launched["abort"].result()
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert re.search(r"ValueError: Current global norm \[\d+\.\d{6}\] of step 4 has been 2 consecutive times "
                     r"greater than threshold 10\.0, stop training\.\.\.", proc.stdout + proc.stderr)
    assert max(e["step"] for e in events(run, "step")) == 3


def test_a_streak_continues_across_resume(launched):
    _, (stopped, proc) = launched["streak"].result()
    ok(stopped)
    assert proc.returncode == 3
    assert "of step 5 has been 3 consecutive times greater than threshold 10.0" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def health_run(launched):
    """Read and copied, never changed in place."""
    return succeeded(launched["health"])


def test_health_file_marks_only_the_faulty_checkpoint(health_run):
    records = json.loads((health_run / "checkpoints/health_ckpts.json").read_text())
    assert records == [
        {"is_health": 0, "ckpt_name": "global_step_2"},
        {"is_health": 0, "ckpt_name": "global_step_4"},
        {"is_health": 0, "ckpt_name": "global_step_6"},
        {"is_health": 1, "ckpt_name": "global_step_8"},
    ]


def test_local_norms_are_recorded_per_rank_and_parameter(health_run):
    local = events(health_run, "local_norm")
    assert {(e["step"], e["rank"]) for e in local} == {(s, r) for s in range(1, 9) for r in range(2)}
    names = set(local[0]["norms"])
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    step8 = [e for e in local if e["step"] == 8]
    embedding = max(e["norms"]["model.embed_tokens.weight"] for e in step8)
    assert embedding > 50.0  # the scaled step, seen in the embedding's local shard
    assert all(v < 50.0 for e in local if e["step"] < 8 for v in e["norms"].values())


def test_auto_resume_excludes_the_unhealthy_checkpoint(health_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(health_run, run)
    proc = ok(train(run, 2, 10, "--save-interval", "2", "--resume", "auto"))
    assert "global_step_8" in proc.stdout and "unhealthy" in proc.stdout
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_6")


def test_explicit_path_to_an_unhealthy_checkpoint_is_honoured(health_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(health_run, run)
    proc = ok(train(run, 2, 10, "--save-interval", "2", "--resume", str(run / "checkpoints/global_step_8")))
    assert "marked unhealthy" in proc.stdout + proc.stderr
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_8")


def test_no_healthy_checkpoint_exits_4_with_the_advice(health_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(health_run, run)
    health_file = run / "checkpoints/health_ckpts.json"
    records = json.loads(health_file.read_text())
    health_file.write_text(json.dumps([{"is_health": 1, "ckpt_name": r["ckpt_name"]} for r in records]))
    proc = train(run, 2, 10, "--save-interval", "2", "--resume", "auto")
    assert proc.returncode == 4
    assert "no healthy checkpoint to resume from" in proc.stderr and "embedding_local_norm_threshold" in proc.stderr


def test_auto_resume_skips_an_unhealthy_step_in_the_local_tier_too(tmp_path):
    """The health verdict holds for both tiers: a step judged unhealthy is not resumed from the local tier
    either (which, at the same or a newer step, is preferred to the durable one)."""
    run = tmp_path / "run"
    common = ("--save-interval", "2", "--set", "checkpoint.local_interval=2", "--set", "guards.health.enabled=true",
              "--set", "guards.health.embedding_threshold=50.0")
    ok(train(run, 2, 8, *common, faults="scale:rank=0,step=8,site=model.layers.0,where=grad_input,factor=1000"))
    assert json.loads((run / "checkpoints/health_ckpts.json").read_text())[-1] == {"is_health": 1,
                                                                                 "ckpt_name": "global_step_8"}
    ok(train(run, 2, 10, *common, "--resume", "auto"))
    started = events(run, "run_started")[-1]
    assert started["step"] == 6 and started["resumed_from"].endswith("global_step_6"), started


def test_adaptive_skip_resumed_after_a_sequence_length_switch_warms_up_again_instead_of_skipping(launched):
    """Issue 39: resumed with shorter sequences, the adaptive guard judged the new norms against the
    old window and skipped 14 of the next 20 steps. The trainer declares its tokens per step to the
    Guard, and a state saved at another count starts a fresh warm-up."""
    run, (first, proc) = launched["adaptive"].result()
    ok(first)
    ok(proc)
    assert "start a fresh warm-up" in proc.stdout + proc.stderr
    assert [e["step"] for e in events(run, "step") if e["step"] > 30 and e["skipped"]] == []
