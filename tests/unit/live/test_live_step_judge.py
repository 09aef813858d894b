"""Live mode's step decision (``live/step_judge.LiveJudge``) is the closure mode's: the same update plugins
(``guards/plugins/``), asked through the same ``decide``, answering a typed ``Decision`` naming the plugin
whose verdict it is; its state keeps the names live checkpoints already hold."""

from __future__ import annotations

import logging
import math

import pytest

from trainguard.guards.plugins.data_skip import DataSkip
from trainguard.guards.plugins.nonfinite import NonFiniteSkip
from trainguard.guards.plugins.sdc import SdcRerun
from trainguard.guards.plugins.skip_streak import SkipStreakLimit
from trainguard.guards.skip import DataSkipAbort, SkipConfig
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_verdict import Decision, StepVerdict
from trainguard.live.step_judge import LiveJudge

APPLY, SKIP, ABORT = StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.ABORT


def judge(emitted: list[str], limit: int = 20, **skip: object) -> LiveJudge:
    return LiveJudge(StepSkips(SkipConfig(**skip), limit, logging.getLogger("test"),
                               lambda kind, **fields: emitted.append(kind), reports=lambda: True))


@pytest.mark.parametrize("data_skip", [False, True])
def test_a_live_step_is_judged_by_the_closure_modes_update_plugins_in_their_order(data_skip):
    live = judge([], enabled=data_skip)
    expected = ([DataSkip] if data_skip else []) + [NonFiniteSkip, SkipStreakLimit]
    assert [type(plugin) for plugin in live.plugins] == expected
    assert all(plugin.skips is live.skips for plugin in live.plugins)


def test_the_decision_names_the_plugin_that_skipped_or_applied():
    emitted: list[str] = []
    live = judge(emitted, enabled=True, threshold=3.0, count_threshold=5)
    applied = live.judge(1, 1.0, 2.0)
    assert applied.verdict is APPLY and applied.by is None
    spiked = live.judge(2, 5.0, 2.0)
    assert spiked.verdict is SKIP and isinstance(spiked.by, DataSkip)
    assert live.skipped == 1 and emitted == ["data_skip"]


def test_a_nonfinite_norm_is_skipped_by_the_nonfinite_plugin_when_data_skip_is_off():
    emitted: list[str] = []
    live = judge(emitted)
    decision = live.judge(1, math.nan, 2.0)
    assert decision.verdict is SKIP and isinstance(decision.by, NonFiniteSkip)
    assert emitted == ["nonfinite_skip"] and live.skipped == 1


def test_an_sdc_skip_is_counted_by_the_streak_which_aborts_at_its_limit():
    emitted: list[str] = []
    live = judge(emitted, limit=2)
    sdc_skip = Decision(SKIP, SdcRerun(votes=None))  # the integrity decision: the SDC plugin's SKIP (not asked here)
    first = live.judge(1, 1.0, 2.0, sdc_skip)
    assert first == sdc_skip  # decided before the update's plugins, as the closure's SDC
    second = live.judge(2, 1.0, 2.0, sdc_skip)
    assert second.verdict is ABORT and isinstance(second.by, SkipStreakLimit)
    cause = second.by.abort_cause()
    assert isinstance(cause, DataSkipAbort) and cause.exit_code == 3
    assert emitted == ["skip_streak_abort"] and live.skipped == 1  # the aborting step is not counted skipped


def test_spikes_in_a_row_abort_with_the_data_skip_plugins_cause():
    live = judge([], enabled=True, threshold=3.0, count_threshold=2)
    assert live.judge(1, 5.0, 2.0).verdict is SKIP
    decision = live.judge(2, 6.0, 2.0)
    assert decision.verdict is ABORT and isinstance(decision.by, DataSkip)
    assert isinstance(decision.by.abort_cause(), DataSkipAbort)


def test_its_state_keeps_the_names_of_live_checkpoints_and_loads_back():
    live = judge([], limit=5, enabled=True, threshold=3.0)
    live.judge(1, 5.0, 2.0)
    state = live.state_dict()
    assert set(state) == {"skipped", "skip_streak", "skip_guard"}
    again = judge([], limit=5, enabled=True, threshold=3.0)
    again.load_state_dict(state)
    assert again.state_dict() == state
