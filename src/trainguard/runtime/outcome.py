"""How a run on ``Guard`` ended, as the loop sees it after ``close()``.

The exit code alone cannot say it: a finished run, one the kill switch stopped and one that started
with the kill switch armed and trained nothing all return 0, and only the first holds the trained
model a loop may export.
"""

from __future__ import annotations

import enum

from trainguard.runtime.lifecycle import DEADLINE, KILL_SWITCH, SIGNAL


class RunOutcome(str, enum.Enum):
    RUNNING = "running"  # close() not reached yet
    FINISHED = "finished"  # total_steps reached (exit 0): the model is the trained one
    EXIT_AT_STEP = "exit_at_step"  # train.exit_at_step reached before total_steps (exit 0)
    KILL_SWITCH = "kill_switch"  # the kill switch stopped training (exit 0), the step it reached saved
    NOT_STARTED = "not_started"  # the kill switch was armed at start: nothing loaded, nothing trained (exit 0)
    SIGNAL = "signal"  # SIGTERM/SIGUSR1 (exit 16), resumable
    TIME_LIMIT = "time_limit"  # lifecycle.exit_duration_in_mins near (exit 16), resumable


def stop_outcome(reason: int, trained: bool) -> RunOutcome:
    """The outcome of a lifecycle stop (``runtime.lifecycle``'s reason); ``trained``: whether the run
    got past ``resume()`` before the stop (a stop found by ``resume()`` loads and trains nothing)."""
    if reason == KILL_SWITCH:
        return RunOutcome.KILL_SWITCH if trained else RunOutcome.NOT_STARTED
    if reason == SIGNAL:
        return RunOutcome.SIGNAL
    if reason == DEADLINE:
        return RunOutcome.TIME_LIMIT
    raise ValueError(f"not a stop reason: {reason}")


def end_outcome(step: int, total_steps: int | None) -> RunOutcome:
    """The outcome of a run that ended without a stop: its total, or ``train.exit_at_step`` before it."""
    return RunOutcome.FINISHED if total_steps is None or step >= total_steps else RunOutcome.EXIT_AT_STEP
