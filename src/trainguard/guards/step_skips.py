"""Whether one step's update is skipped, with the lines and events that say so: the data-skip rule
(``skip.DataSkipGuard``), a non-finite global norm, and the skip streak (``skip_streak.SkipStreak``).

Both step engines use it, on a global norm and a loss every rank holds alike (the closure mode's after
its all-reduce, live mode's after the order-fixed sum), so every rank takes the same verdict and counts
alike. ``reports()`` says whether this rank writes the events (one rank of the run: the closure mode's
rank 0, live mode's first member of the quorum); every rank logs the reference's lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainguard.errors import raised_by_every_rank
from trainguard.guards.skip import (DataSkipAbort, DataSkipGuard, SkipConfig, reference_abort_message,
                                    reference_log_lines)
from trainguard.guards.skip_streak import SkipStreak


class StepSkips:
    """``spike`` (the data-skip rule, when ``guards.skip.enabled``), ``nonfinite`` (always) and ``count``
    (the streak, ``guards.max_consecutive_skips``) of one step; an abort raises ``DataSkipAbort`` (exit 3)."""

    def __init__(self, skip: SkipConfig, max_consecutive_skips: int, log: logging.Logger,
                 emit: Callable[..., Any], reports: Callable[[], bool], tokens_per_step: int | None = None):
        self.data_skip = DataSkipGuard(skip, tokens_per_step) if skip.enabled else None
        self.streak = SkipStreak(max_consecutive_skips)
        self.log, self.emit, self.reports = log, emit, reports

    @property
    def stateful(self) -> dict[str, Any]:
        """Their state, by the names checkpoints keep it under."""
        return {"skip_streak": self.streak, **({"skip_guard": self.data_skip} if self.data_skip is not None else {})}

    def totals(self) -> dict[str, int] | None:
        """The data-skip guard's counts that a step's line and event carry; None when it is off."""
        if self.data_skip is None:
            return None
        return {"skipped_total": self.data_skip.skipped_total, "nan_total": self.data_skip.nan_total}

    def spike(self, step: int, norm: float, loss: float | None) -> bool:
        """The data-skip rule's verdict on ``step`` (the closure mode's 1-based number); False when it is off."""
        if self.data_skip is None:
            return False
        decision = self.data_skip.decide(step, norm, opt_global_step=step - 1 - self.data_skip.skipped_total,
                                         loss=loss)
        for line in reference_log_lines(decision):
            self.log.info(line)
        if decision.skip and self.reports():
            self.emit("data_skip", step=step, global_norm=norm, threshold=decision.threshold,
                      consecutive=decision.consecutive, nan=decision.nan)
        if decision.abort:
            message = reference_abort_message(decision)
            self.log.error("ValueError: %s", message)
            if self.reports():
                self.emit("data_skip_abort", step=step, global_norm=norm, message=message)
            raise DataSkipAbort(f"ValueError: {message}")
        return decision.skip

    def nonfinite(self, step: int, norm: float) -> bool:
        """A NaN/Inf global norm never reaches the optimizer, whatever the guards' settings: it would
        poison every weight. The data's or the math's, not a device fault: no strike."""
        self.log.warning("step %d: the global norm is %s: the update is skipped", step, norm)
        if self.reports():
            self.emit("nonfinite_skip", step=step, global_norm=norm)
        return True

    def count(self, step: int, skipped: bool) -> None:
        """A run that skips every step trains nothing: at ``guards.max_consecutive_skips`` skipped steps in
        a row (any cause) it ends with exit 3 instead of reporting success. The skip decision is every
        rank's alike, so they all stop here together."""
        if not self.streak.note(skipped).abort:
            return
        message = self.streak.message(step)
        self.log.error(message)
        if self.reports():
            self.emit("skip_streak_abort", step=step, consecutive=self.streak.consecutive, limit=self.streak.limit)
        raise raised_by_every_rank(DataSkipAbort(message))
