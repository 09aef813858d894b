"""Typed verdicts of the step: the SDC rerun verdict, the step report, the rollback data protocol."""

from __future__ import annotations

import pytest

from trainguard.errors import ConfigError
from trainguard.events.step_report import StepReport
from trainguard.checkpoint.rollback import SkippableData, skippable_data
from trainguard.step.sdc import RerunVerdict
from trainguard.trainer.data import StatefulSampler


def test_the_strongest_rerun_verdict_wins_and_is_spelled_as_in_events():
    assert max([RerunVerdict.TRANSIENT, RerunVerdict.FAULTY, RerunVerdict.REPRODUCIBLE]) is RerunVerdict.FAULTY
    assert [v.label for v in RerunVerdict] == ["none", "transient", "reproducible", "faulty"]
    assert RerunVerdict.NONE < RerunVerdict.TRANSIENT < RerunVerdict.REPRODUCIBLE < RerunVerdict.FAULTY
    # issue 38 item 10: no rerun, no claim that the value reproduced
    assert [v.label_after(reran=False) for v in RerunVerdict] == ["none", "transient", "unverified", "faulty"]
    assert [v.label_after(reran=True) for v in RerunVerdict] == [v.label for v in RerunVerdict]


def test_report_line_and_event_fields_in_the_reference_trainer_spelling():
    report = StepReport(step=5, total=40, loss=2.34567, global_norm=1.23456, lr=3e-4, seconds=0.25, skipped=True,
                        tokens_per_step=1000, skip_totals={"skipped_total": 2, "nan_total": 1},
                        embedding_local_norm=0.123456)
    assert report.log_lines() == [
        "step: [    5/   40], loss: 2.346, global_norm: [1.235], lr: 3.0e-04, per_step_time: 250ms, tokens/s: 4000, "
        "number of skipped iterations: 2, number of nan iterations: 1",
        "embedding_local_norm: 0.12346",
    ]
    assert list(report.event_fields()) == ["step", "loss", "global_norm", "lr", "step_time", "tokens_per_s", "skipped",
                                           "skipped_total", "nan_total", "embedding_local_norm"]
    assert report.due(log_interval=5) and not StepReport(6, 40, 0, 0, 0, 1, False).due(log_interval=5)
    assert StepReport(7, 7, 0, 0, 0, 1, False).due(log_interval=5)  # the last step is always logged


def test_a_loop_without_tokens_per_step_leaves_the_figure_out():
    report = StepReport(step=1, total=None, loss=1.0, global_norm=1.0, lr=1e-3, seconds=0.5, skipped=False)
    assert report.log_lines()[0].endswith("per_step_time: 500ms") and "tokens_per_s" not in report.event_fields()


def test_rollback_finds_the_one_data_object_that_can_skip_samples():
    sampler = StatefulSampler(100, dp_rank=0, dp_size=1, micro_batch_size=2, seed=0)
    assert isinstance(sampler, SkippableData)
    assert skippable_data({"sampler": sampler, "other": object()}) is sampler


def test_rollback_without_skippable_data_is_one_clear_error():
    class Loader:
        def state_dict(self):
            return {}

    with pytest.raises(ConfigError, match=r"rollback mode\) needs exactly one stateful data object .*'data'"):
        skippable_data({"data": Loader()})


def test_the_run_outcome_tells_apart_what_exit_0_does_not():
    """Issue 38 item 8: finished, exit_at_step, the kill switch and a start with it armed all exit 0."""
    from trainguard.runtime.lifecycle import DEADLINE, KILL_SWITCH, SIGNAL
    from trainguard.runtime.outcome import RunOutcome, end_outcome, stop_outcome

    assert end_outcome(20, 20) is RunOutcome.FINISHED and end_outcome(7, None) is RunOutcome.FINISHED
    assert end_outcome(7, 20) is RunOutcome.EXIT_AT_STEP
    assert stop_outcome(KILL_SWITCH, trained=True) is RunOutcome.KILL_SWITCH
    assert stop_outcome(KILL_SWITCH, trained=False) is RunOutcome.NOT_STARTED
    assert [stop_outcome(r, trained=True) for r in (SIGNAL, DEADLINE)] == [RunOutcome.SIGNAL, RunOutcome.TIME_LIMIT]
