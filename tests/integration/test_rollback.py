"""Rollback mode in live 2-rank runs of the reference trainer: restore, skipped samples, restart, widening, stop."""

from __future__ import annotations

import re
import shutil

import pytest

from helpers.runs import events, launched_fixture, ok, train
from trainguard.fs.layout import extra_state_name
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens

ROLLBACK = ["--set", "guards.check_for_global_norm=true", "--set", "guards.skip.threshold=10.0",
            "--set", "guards.rollback.window_before=1", "--set", "guards.rollback.window_after=1"]
GLOBAL_BATCH = 4  # 2 ranks x micro_batch_size 2 (conftest.TINY), one micro-batch per step


def positions(ranges) -> list[int]:
    return [p for start, end in ranges for p in range(start, end)]


def sampler_state(ckpt_dir, rank=0) -> dict:
    return safe_torch_load(ckpt_dir / extra_state_name(2, rank))["stateful"]["sampler"]


RUNS = {  # name: the runs of one fixture or test (a function of its directory), independent of each other
    # a spike at step 6 with checkpoints every 2 steps; stopped at step 8, then restarted to step 10
    "spike": lambda run: (train(run, 2, 10, "--save-interval", "2", *ROLLBACK, "--set", "train.exit_at_step=8",
                                faults="spike:step=6"),
                          train(run, 2, 10, "--save-interval", "2", *ROLLBACK, faults="spike:step=6")),
    "recurring": lambda run: train(run, 2, 10, "--save-interval", "2", *ROLLBACK, "--set",
                                   "guards.rollback.max_rollbacks=2", faults="spike:step=6,persistent=1"),
}
launched = launched_fixture("rollback", RUNS)  # two at a time (helpers/runs.py's launch_together)


@pytest.fixture(scope="module")
def spike_run(launched):
    run, (first, second) = launched["spike"].result()
    ok(first)
    ok(second)
    return run, first.stdout + first.stderr, second.stdout + second.stderr


def test_a_spike_rolls_back_to_the_checkpoint_before_it_and_skips_the_window(spike_run):
    run, out, _ = spike_run
    (rollback,) = events(run, "rollback")
    assert rollback["step"] == 6 and rollback["to_step"] == 4 and rollback["metric"] == "global_norm"
    assert rollback["window"] == [5, 7] and rollback["attempt"] == 1
    # steps 5, 6 and 7 would have trained on global positions 16..27
    assert rollback["skipped"] == [[16, 28]] and rollback["skipped_samples"] == 12
    assert "restored global_step_4 and skipping the batches of steps 5-7 (global samples [16, 28))" in out
    assert events(run, "run_finished")[-1]["step"] == 10


def test_the_skipped_sample_indices_are_never_trained_on_again(spike_run):
    run, _, _ = spike_run
    steps = events(run, "step")
    trained = [(e["step"], e["sample_ranges"]) for e in steps]
    rolled = next(i for i in range(1, len(trained)) if trained[i][0] <= trained[i - 1][0])
    before, after = trained[:rolled], trained[rolled:]
    assert [s for s, _ in before] == [1, 2, 3, 4, 5] and [s for s, _ in after] == [5, 6, 7, 8, 9, 10]
    assert before[-1][1] == [[16, 20]]  # step 5's batch before the rollback: inside the window
    assert positions(r for _, ranges in after for r in ranges) == list(range(28, 52))  # after it, no gap
    sampler = StatefulSampler(len(TokenDataset(load_corpus_tokens(), 32)), 0, 1, 1, seed=1234)
    window = set(sampler.peek_global_indices(16, 12))
    trained_after = set(sampler.peek_global_indices(28, 24))
    assert len(window) == 12 and not window & trained_after


def test_the_skipped_ranges_are_in_every_later_checkpoint_and_survive_a_restart(spike_run):
    run, _, restarted = spike_run
    assert events(run, "run_started")[-1]["resumed_from"].endswith("global_step_8")
    for step, consumed in ((8, 44), (10, 52)):
        for rank in (0, 1):
            state = sampler_state(run / f"checkpoints/global_step_{step}", rank)
            assert state["skipped"] == [[16, 28]] and state["consumed_samples"] == consumed
    assert "rollback:" not in restarted  # the one-shot spike fired once, in the first incarnation


def test_a_recurring_spike_widens_the_window_then_stops_with_exit_3(launched):
    run, proc = launched["recurring"].result()
    assert proc.returncode == 3, proc.stderr[-2000:]
    rollbacks = events(run, "rollback")
    assert [(e["to_step"], e["window"], e["attempt"], e["skipped"]) for e in rollbacks] == [
        (4, [5, 7], 1, [[16, 28]]),
        (4, [5, 8], 2, [[28, 44]]),  # widened to 2 steps after the spike; steps 5-8 now start at 28
    ]
    (abort,) = events(run, "rollback_abort")
    assert abort["step"] == 6
    assert re.search(r"trainguard: error: \[rank 0\] rollback: global_norm \[\d+\.\d{6}\] of step 6 is greater than "
                     r"threshold 10\.0 and recurred after 2 rollbacks without progress "
                     r"\(guards\.rollback\.max_rollbacks=2\); skipped windows: steps 5-7, steps 5-8; "
                     r"rollbacks in this run: 2, stop training\.\.\.", proc.stderr)
    assert not events(run, "run_finished")
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_4"]


def test_checkpoints_of_the_abandoned_timeline_are_deleted(committed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(committed_run, run)  # checkpoints at 4 and 8, saved without rollback mode
    ok(train(run, 2, 8, "--save-interval", "4", "--resume", str(run / "checkpoints/global_step_4"), *ROLLBACK,
             faults="spike:step=6"))
    (rollback,) = events(run, "rollback")
    assert rollback["to_step"] == 4
    deleted = [e for e in events(run, "checkpoint_deleted") if e["reason"] == "abandoned by a rollback"]
    assert [e["step"] for e in deleted] == [8]
    assert rollback["skipped"] == [[16, 28]]
    assert sampler_state(run / "checkpoints/global_step_8")["skipped"] == [[16, 28]]  # the redone step 8
    assert (run / "checkpoints/latest_checkpointed_iteration.txt").read_text() == "8\n"
