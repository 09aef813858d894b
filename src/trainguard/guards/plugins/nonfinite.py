"""A NaN/Inf global norm as a plugin: SKIP whatever the guards' settings (it would poison every weight),
asked after the data skip and rollback mode, which judge such a norm a spike themselves."""

from __future__ import annotations

import math

from trainguard.guards.step_plugin import GuardPlugin, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_verdict import StepVerdict


class NonFiniteSkip(GuardPlugin):
    def __init__(self, skips: StepSkips):
        self.skips = skips

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        norm = check.reduced.global_norm
        if math.isfinite(norm):
            return StepVerdict.APPLY
        self.skips.nonfinite(check.step, norm)  # says so in the log and the events
        return StepVerdict.SKIP
