"""Rollback mode (``guards.check_for_global_norm``: ``guards/rollback.RollbackGuard`` and its I/O side,
``step/rollback.roll_back``) as a plugin: ROLLBACK on a global-norm (or loss) spike, carried out by
restoring the newest healthy checkpoint before it and skipping the data around it; ABORT when the spike
recurred too often or there is nothing to restore (exit 3)."""

from __future__ import annotations

from trainguard.checkpoint.manager import CheckpointManager
from trainguard.events import EventLog
from trainguard.guards.rollback import RollbackAbort, RollbackGuard, Spike
from trainguard.guards.step_plugin import GuardPlugin, Restored, StepCheck
from trainguard.guards.step_verdict import StepVerdict
from trainguard.step.rollback import SkippableData, roll_back


class SpikeRollback(GuardPlugin):
    def __init__(self, rollback: RollbackGuard, data: SkippableData, checkpoints: CheckpointManager, events: EventLog,
                 rank: int):
        self.rollback, self.data, self.checkpoints, self.events, self.rank = rollback, data, checkpoints, events, rank
        self.spike: Spike | None = None
        self.abort: RollbackAbort | None = None

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        reduced = check.reduced
        self.spike = self.rollback.check(check.step, reduced.global_norm, reduced.loss)
        return StepVerdict.ROLLBACK if self.spike is not None else StepVerdict.APPLY

    def roll_back(self, check: StepCheck) -> StepVerdict:
        drawn = self.data.ranges_between(check.first_sample, self.data.consumed_samples)
        try:
            restored = roll_back(self.spike, self.rollback, self.data, self.checkpoints, self.events, self.rank,
                                 samples_per_step=sum(b - a for a, b in drawn))
        except RollbackAbort as abort:  # logged and reported: the step ends the run with it
            self.abort = abort
            return StepVerdict.ABORT
        self.restored = Restored(restored, check.reduced.loss, check.reduced.global_norm)
        return StepVerdict.ROLLBACK

    def abort_cause(self) -> RollbackAbort:
        return self.abort
