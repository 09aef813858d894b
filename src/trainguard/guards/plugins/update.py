"""The plugins that decide whether a step's update is applied, in the order they are asked, for both step
engines: the closure mode's skeleton (``step/builder.build_step_plugins``) and live mode's judge
(``live/step_judge.LiveJudge``)."""

from __future__ import annotations

from trainguard.guards.plugins.data_skip import DataSkip
from trainguard.guards.plugins.nonfinite import NonFiniteSkip
from trainguard.guards.plugins.skip_streak import SkipStreakLimit
from trainguard.guards.step_plugin import GuardPlugin
from trainguard.guards.step_skips import StepSkips


def update_plugins(skips: StepSkips, rollback: GuardPlugin | None = None) -> list[GuardPlugin]:
    """The data skip and rollback mode (``rollback``: never both, the config refuses it) before the
    non-finite norm, which they judge a spike themselves; the streak last, counting whatever skipped the
    step (``guards/step_verdict.decide`` asks it whatever was decided)."""
    plugins: list[GuardPlugin] = []
    if skips.data_skip is not None:
        plugins.append(DataSkip(skips))
    if rollback is not None:
        plugins.append(rollback)
    return plugins + [NonFiniteSkip(skips), SkipStreakLimit(skips)]
