"""The skip streak: N skipped steps in a row, whatever skipped them, abort the run (exit 3)."""

from __future__ import annotations

import pytest

from trainguard.errors import CheckpointError
from trainguard.guards.skip_streak import SkipStreak, StreakVerdict


def test_the_limit_th_skip_in_a_row_aborts_and_an_applied_step_resets_the_count():
    streak = SkipStreak(3)
    assert [streak.note(skipped) for skipped in (True, True, False, True, True)] == [
        StreakVerdict(1, False), StreakVerdict(2, False), StreakVerdict(0, False), StreakVerdict(1, False),
        StreakVerdict(2, False)]
    assert streak.note(True) == StreakVerdict(3, True)
    assert "the last 3 steps were all skipped" in streak.message(9) and "guards.max_consecutive_skips 3" in streak.message(9)


def test_zero_never_aborts_and_a_bad_limit_is_refused():
    streak = SkipStreak(0)
    assert not any(streak.note(True).abort for _ in range(1000))
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="non-negative integer"):
            SkipStreak(bad)


def test_the_count_survives_a_checkpoint_and_malformed_state_is_refused():
    streak = SkipStreak(4)
    for _ in range(3):
        streak.note(True)
    resumed = SkipStreak(4)
    resumed.load_state_dict(streak.state_dict())
    assert resumed.note(True).abort
    for bad in ({}, {"consecutive": -1}, {"consecutive": 1.5}, {"consecutive": True}, None):
        with pytest.raises(CheckpointError, match="skip streak state is malformed"):
            SkipStreak(4).load_state_dict(bad)
