"""Data skip on global-norm spikes (``guards.skip``, through ``guards/step_skips.StepSkips``) as a plugin:
SKIP on a spike, ABORT when the spikes in a row reach ``count_threshold`` (the reference's lines and
events, exit 3)."""

from __future__ import annotations

from trainguard.guards.skip import DataSkipAbort
from trainguard.guards.step_plugin import GuardPlugin, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_verdict import StepVerdict


class DataSkip(GuardPlugin):
    def __init__(self, skips: StepSkips):
        self.skips = skips
        self.abort: DataSkipAbort | None = None

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        reduced = check.reduced
        try:
            skipped = self.skips.spike(check.step, reduced.global_norm, reduced.loss)
        except DataSkipAbort as abort:  # its lines and events are written: the step ends the run with it
            self.abort = abort
            return StepVerdict.ABORT
        return StepVerdict.SKIP if skipped else StepVerdict.APPLY

    def abort_cause(self) -> DataSkipAbort:
        return self.abort
