"""A live step's decision, taken as the closure mode takes it: the same update plugins
(``guards/plugins/update.update_plugins``: the data-skip rule or rollback mode's spike test and rollback,
``checkpoint/spike_rollback.SpikeRollback``, a non-finite global norm, the skip streak)
asked through the same precedence (``guards/step_engine.decide_step``), going on from the integrity
decision (SDC detection's plugin, ``guards/plugins/sdc.SdcRerun``, which ``live/worker.LiveStep`` asks),
plus SDC detection's state (``live/sdc.py``: its detectors and strikes, when ``guards.sdc`` is on). Their
state travels with the model and the optimizer: kept for an undone step, sent to a joining rank, saved in
the durable tier.

The decision is agreed by construction: every rank judges the same summed gradient (the order-fixed sum)
with the same state, so every rank of every replica group skips, or aborts, at the same step.
"""

from __future__ import annotations

from typing import Any, NoReturn

from trainguard.errors import CheckpointError
from trainguard.checkpoint.spike_rollback import SpikeRollback
from trainguard.guards.plugins.update import update_plugins
from trainguard.guards.step_engine import decide_step
from trainguard.guards.step_plugin import GuardPlugin, RerunJudge, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_slots import Reduced, Slot
from trainguard.guards.step_verdict import Decision, StepVerdict
from trainguard.live.data_positions import DataPositions
from trainguard.live.sdc import LiveSdc

# a live step raises no indicator of the closure mode's all-reduce: SDC detection's values ride in the sum's extras
NO_INDICATORS = {slot: 0 for slot in Slot if slot != Slot.LOSS}


def live_check(step: int, norm: float, loss: float) -> StepCheck:
    """What a live step's plugins judge it by: its norm and loss as every member holds them after the sum."""
    return StepCheck(step, Reduced(norm, loss, NO_INDICATORS), first_sample=None)


def no_rerun(plugin: RerunJudge) -> NoReturn:
    raise ValueError(f"{type(plugin).__name__} asked for a rerun of a live step's update, which only SDC detection "
                     "reruns, before it")


class LiveJudge:
    """``judge`` a step; ``skipped``: the steps skipped so far, whatever the cause (the scheduler stands
    still on them: it steps with an applied update only, ``LiveState.after_update``). ``rollback``: rollback
    mode's plugin, which skips ``positions``' windows (its guard's and their state ride in this one's)."""

    def __init__(self, skips: StepSkips, sdc: LiveSdc | None = None, rollback: SpikeRollback | None = None,
                 positions: DataPositions | None = None):
        self.skips = skips
        self.plugins = update_plugins(skips, rollback)
        self.sdc = sdc
        self.rollback, self.positions = rollback, positions
        self.skipped = 0

    def judge(self, step: int, norm: float, loss: float,
              decided: Decision[GuardPlugin] | None = None) -> Decision[GuardPlugin]:
        """The decision on ``step`` (the closure mode's 1-based number): APPLY, SKIP, ROLLBACK (carried out:
        ``by.restored``) or ABORT (its ``by.abort_cause()``, a ``DataSkipAbort``, ends the run; its lines and
        events are written).
        ``decided``: the integrity decision it goes on from; an SDC detection's SKIP, which the skip streak
        counts as the closure mode's does."""
        check = live_check(step, norm, loss)
        decision = decide_step(self.plugins, lambda: check, no_rerun, decided)
        self.skipped += decision.verdict is StepVerdict.SKIP
        return decision

    def welcome(self, joining: list[int]) -> None:
        """Every member, once ``joining`` ranks received the state: what was kept against those ranks
        (SDC strikes) was their predecessors'."""
        if self.sdc is not None:
            self.sdc.forget(joining)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats and lists: loads with ``torch.load(weights_only=True)``."""
        return {"skipped": self.skipped, **{name: obj.state_dict() for name, obj in self.stateful().items()},
                **(self.sdc.state() if self.sdc is not None else {})}

    def stateful(self) -> dict[str, Any]:
        """The guards' objects whose state rides in this one's, by name."""
        rollback = {} if self.rollback is None else {"rollback": self.rollback.rollback,
                                                     "data_positions": self.positions}
        return {**self.skips.stateful, **rollback}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        skipped = state.get("skipped") if isinstance(state, dict) else None
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise CheckpointError(f"live guards' state is malformed: skipped must be a non-negative integer, "
                                  f"got {skipped!r}")
        for name, obj in self.stateful().items():
            if name in state:
                obj.load_state_dict(state[name])
        if self.sdc is not None and "sdc_detector" in state:  # a state saved with SDC detection off has none
            self.sdc.load(state)
        self.skipped = skipped
