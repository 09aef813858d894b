"""The state guard (``guards/state_guard.py``: replica fingerprints, shards changed at rest) as a plugin.

Asked twice a step, by two instances: before the backward (``before_backward``: the at-rest comparison
of a fingerprint step) and after the all-reduce (the every-step check whose flag, ``STATE_AT_REST``,
rides it). When a check found something: ABORT when a rank's device reached its strike limit, ROLLBACK
when a corrupt shard that no replica can repair asks for a recompute, else APPLY (repaired in place,
or recorded unrepaired so that the next save is marked unhealthy).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from trainguard.checkpoint.manager import CheckpointManager
from trainguard.events import EventLog
from trainguard.guards.fingerprint import log_recompute, restore_agreeing
from trainguard.guards.state_guard import StateGuard
from trainguard.guards.step_plugin import Exclusion, GuardPlugin, Restored, StepCheck
from trainguard.guards.step_slots import Slot
from trainguard.guards.step_verdict import StepVerdict


class StatePlugin(GuardPlugin):
    def __init__(self, state: StateGuard, checkpoints: CheckpointManager, events: EventLog, rank: int,
                 log: logging.Logger, *, before_backward: bool):
        self.state, self.checkpoints, self.events, self.rank, self.log = state, checkpoints, events, rank, log
        self.before_backward = before_backward

    def flags(self, step: int) -> dict[Slot, Any]:
        if self.before_backward:
            return {}
        return {Slot.STATE_AT_REST: self.state.changed_at_rest()}

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        if self.before_backward:
            found = self.state.before_step(check.step) is not None
        else:
            # the state, not this step's computation, is at fault: a recompute replaces the step (with
            # nothing to recompute from, it goes on, and every later save is marked unhealthy)
            found = check.reduced.count(Slot.STATE_AT_REST) > 0
            if found:
                self.state.after_change_at_rest(check.step)
        return state_verdict(found, bool(self.state.struck_out), self.state.recompute)

    def abort_cause(self) -> Exclusion:
        return Exclusion(list(self.state.struck_out), "fingerprint mismatches")

    def roll_back(self, check: StepCheck) -> StepVerdict:
        """A corrupt shard that no replica can repair (2 replicas disagree with neither changed at rest,
        or a shard changed at rest with no replica): rolls back to the newest healthy checkpoint (its
        replicas agreed when it was saved) so that the run recomputes the steps since and the check at
        this step can tell which rank computed wrongly. APPLY when there is none."""
        step = check.step
        restored = restore_agreeing(step, lambda before: self.checkpoints.roll_back(before_step=before),
                                    self.state.restored_agrees, self.log)
        self.state.recomputing_from(restored)
        log_recompute(self.log, step, restored)
        if restored is None:
            return StepVerdict.APPLY
        if self.rank == 0:
            self.events.emit("fingerprint_recompute", step=step, to_step=restored)
        self.restored = Restored(restored, math.nan, math.nan)  # no step's scalars: the step is recomputed
        return StepVerdict.ROLLBACK


def state_verdict(found: bool, struck_out: bool, recompute: bool) -> StepVerdict:
    """After a check: a struck-out device ends the run before any recompute is tried."""
    if not found:
        return StepVerdict.APPLY
    if struck_out:
        return StepVerdict.ABORT
    return StepVerdict.ROLLBACK if recompute else StepVerdict.APPLY
