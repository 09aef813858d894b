"""The skip streak (``guards.max_consecutive_skips``) as a plugin: asked at every step that is not rolled
back or aborted, whatever skipped it, it counts skipped steps in a row and answers ABORT (exit 3) at the
limit; otherwise it leaves the step's verdict as it is (APPLY)."""

from __future__ import annotations

from trainguard.guards.skip import DataSkipAbort
from trainguard.guards.step_plugin import GuardPlugin, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_verdict import StepVerdict


class SkipStreakLimit(GuardPlugin):
    watches_every_step = True

    def __init__(self, skips: StepSkips):
        self.skips = skips
        self.abort: DataSkipAbort | None = None

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        try:
            self.skips.count(check.step, decided is StepVerdict.SKIP)
        except DataSkipAbort as abort:  # its line and event are written: the step ends the run with it
            self.abort = abort
            return StepVerdict.ABORT
        return StepVerdict.APPLY

    def abort_cause(self) -> DataSkipAbort:
        return self.abort
