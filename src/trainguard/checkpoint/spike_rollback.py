"""Rollback mode (``guards.check_for_global_norm``: ``guards/rollback.RollbackGuard`` and its I/O side,
``checkpoint/rollback.roll_back``) as a plugin of both step engines: ROLLBACK on a global-norm (or loss)
spike, carried out by restoring the newest healthy checkpoint before it and skipping the data around it;
ABORT when the spike recurred too often or there is nothing to restore (exit 3).

The closure mode (``step/builder.py``) hands it the reference trainer's sampler and the checkpoint manager;
live mode (``live/step_judge.py``) its data positions (one a step) and the quorum's restore."""

from __future__ import annotations

from collections.abc import Callable

from trainguard.checkpoint.rollback import RestoresBefore, SkippableData, roll_back
from trainguard.events import EventLog
from trainguard.guards.rollback import RollbackAbort, RollbackGuard, Spike
from trainguard.guards.step_plugin import GuardPlugin, Restored, StepCheck
from trainguard.guards.step_verdict import StepVerdict


class SpikeRollback(GuardPlugin):
    """``samples_of(check)``: the global samples the spiked step drew; ``reports()``: this rank writes the
    rollback's events (the closure mode's rank 0, live mode's quorum's first member)."""

    def __init__(self, rollback: RollbackGuard, data: SkippableData, checkpoints: RestoresBefore, events: EventLog,
                 samples_of: Callable[[StepCheck], int], reports: Callable[[], bool]):
        self.rollback, self.data, self.checkpoints, self.events = rollback, data, checkpoints, events
        self.samples_of, self.reports = samples_of, reports
        self.spike: Spike | None = None
        self.abort: RollbackAbort | None = None

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        reduced = check.reduced
        self.spike = self.rollback.check(check.step, reduced.global_norm, reduced.loss)
        return StepVerdict.ROLLBACK if self.spike is not None else StepVerdict.APPLY

    def roll_back(self, check: StepCheck) -> StepVerdict:
        try:
            restored = roll_back(self.spike, self.rollback, self.data, self.checkpoints, self.events, self.reports(),
                                 samples_per_step=self.samples_of(check))
        except RollbackAbort as abort:  # logged and reported: the step ends the run with it
            self.abort = abort
            return StepVerdict.ABORT
        self.restored = Restored(restored, check.reduced.loss, check.reduced.global_norm)
        return StepVerdict.ROLLBACK

    def abort_cause(self) -> RollbackAbort:
        return self.abort
