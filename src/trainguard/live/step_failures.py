"""A live step whose own computation raised: the user's ``loss_of`` (or its backward) failed on some
rank, with no peer lost. Such an error is not a failed collective: ending the epoch and recovering
would redo the same step and fail again, for ever (a recovery loop seen at epoch 553). The failing
rank sends zeros for the micro-batches it could not compute and a flag in the step's sum, so every
member learns of it at the same step; none commits the step, and the quorum tries it again, up to
``fault_tolerance.max_step_failures`` times in a row (a transient error passes on a retry, bitwise
as if it had not happened: the micro-batches' draws are a function of the step). Then every member
ends with ``EXIT_STEP_FAILED``, which neither the live launcher nor the supervisor restarts, and
nothing is saved at that step: the newest committed checkpoint stays the resume point.

Pure: ``StepFailures`` counts, the worker sends and reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainguard.errors import EXIT_STEP_FAILED, TrainguardError

STEP_FAILURE = "step_failure"
"""The store key a failing rank writes its error to (the last one written wins), for the line that ends the run."""


class StepFailed(TrainguardError):
    """The same live step failed ``max_step_failures`` times in a row: every member of the quorum ends."""

    exit_code = EXIT_STEP_FAILED


class StepFailureVerdict(enum.Enum):
    RETRY = "retry"  # the quorum computes the step again
    END = "end"  # the step failed too often in a row: the run ends


@dataclass
class StepFailures:
    """Consecutive failures of one step: ``failed`` after each failed attempt, ``committed`` after each
    committed step (any commit ends the streak)."""

    limit: int  # fault_tolerance.max_step_failures: the attempts of one step before the run ends
    step: int | None = None
    count: int = 0

    def failed(self, step: int) -> StepFailureVerdict:
        self.count = self.count + 1 if step == self.step else 1
        self.step = step
        return StepFailureVerdict.END if self.count >= self.limit else StepFailureVerdict.RETRY

    def committed(self) -> None:
        self.step, self.count = None, 0


def failure_text(error: BaseException) -> str:
    """One line naming an error: its type and the first line of its message."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__
