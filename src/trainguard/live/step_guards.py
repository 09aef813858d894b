"""The closure mode's skip decisions on a live step (``guards.step_skips.StepSkips``: the data-skip rule,
a non-finite global norm, the skip streak), SDC detection's state (``live/sdc.py``: its detectors and
strikes, when ``guards.sdc`` is on) and their state, which travels with the model and the
optimizer: kept for an undone step, sent to a joining rank, saved in the durable tier.

The verdict is agreed by construction: every rank judges the same summed gradient (the order-fixed sum)
with the same state, so every rank of every replica group skips, or aborts, at the same step.
"""

from __future__ import annotations

import math
from typing import Any

from trainguard.errors import CheckpointError
from trainguard.guards.step_skips import StepSkips
from trainguard.live.sdc import LiveSdc


class LiveGuards:
    """``judge`` a step; ``skipped``: the steps skipped so far, whatever the cause (the scheduler stands
    still on them: it steps with an applied update only, ``LiveState.after_update``)."""

    def __init__(self, skips: StepSkips, sdc: LiveSdc | None = None):
        self.skips = skips
        self.sdc = sdc
        self.skipped = 0

    def judge(self, step: int, norm: float, loss: float, sdc_skipped: bool = False) -> bool:
        """Whether ``step`` (the closure mode's 1-based number) is skipped (``sdc_skipped``: SDC detection
        dropped it already, which the skip streak counts as the closure mode's does); ``DataSkipAbort``
        ends the run."""
        skipped = sdc_skipped or self.skips.spike(step, norm, loss)
        if not skipped and not math.isfinite(norm):
            skipped = self.skips.nonfinite(step, norm)
        self.skips.count(step, skipped)
        self.skipped += skipped
        return skipped

    def welcome(self, joining: list[int]) -> None:
        """Every member, once ``joining`` ranks received the state: what was kept against those ranks
        (SDC strikes) was their predecessors'."""
        if self.sdc is not None:
            self.sdc.forget(joining)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats and lists: loads with ``torch.load(weights_only=True)``."""
        return {"skipped": self.skipped, **{name: obj.state_dict() for name, obj in self.skips.stateful.items()},
                **(self.sdc.state() if self.sdc is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        skipped = state.get("skipped") if isinstance(state, dict) else None
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise CheckpointError(f"live guards' state is malformed: skipped must be a non-negative integer, "
                                  f"got {skipped!r}")
        for name, obj in self.skips.stateful.items():
            if name in state:
                obj.load_state_dict(state[name])
        if self.sdc is not None and "sdc_detector" in state:  # a state saved with SDC detection off has none
            self.sdc.load(state)
        self.skipped = skipped
