"""The closure mode's inputs of the SDC plugin (``guards/plugins/sdc.SdcRerun``, which decides in both modes):
what ``step/sdc.py``'s ``SdcGuard`` found on this rank, and what the step's all-reduce tells every rank.

After the backward, a rank whose detection points saw a level-1 value raises ``SDC_STOP`` (and
``SDC_LOCAL`` when it was at a point it computed alone): any count asks for the rerun. After the rerun (or
instead of it, ``guards.sdc.rerun: false``) each rank attributes its detection, and the rerun's all-reduce
carries every rank's ``RerunVerdict`` as a count in its slot; a gather, on this rare path only, says which
rank said what (the ``sdc_rerun`` event, the faulty ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.guards.plugins.sdc import RerunOutcome
from trainguard.guards.sdc import SdcConfig
from trainguard.guards.step_plugin import StepCheck
from trainguard.guards.step_slots import Reduced, Slot
from trainguard.step.sdc import RerunVerdict, SdcGuard

# the slot each rank raises for its verdict after a rerun
VERDICT_SLOTS = {RerunVerdict.TRANSIENT: Slot.SDC_TRANSIENT, RerunVerdict.REPRODUCIBLE: Slot.SDC_REPRODUCIBLE,
                 RerunVerdict.FAULTY: Slot.SDC_FAULTY}


class ClosureSdcVotes:
    """``guards/plugins/sdc.SdcVotes`` through the closure mode's all-reduce of slots."""

    def __init__(self, sdc: SdcGuard, events: EventLog, rank: int, world_size: int, device: torch.device):
        self.sdc, self.events, self.rank, self.world_size, self.device = sdc, events, rank, world_size, device
        self.alone = False  # one rank only saw a level-1 value at a point it computed alone
        self.attributed = RerunVerdict.NONE  # this rank's verdict after the rerun

    @property
    def config(self) -> SdcConfig:
        return self.sdc.config

    def flags(self, step: int) -> dict[Slot, Any]:
        detected = self.sdc.check(step)
        return {Slot.SDC_STOP: detected, Slot.SDC_LOCAL: detected and self.sdc.detected_locally}

    def detected(self, check: StepCheck) -> bool:
        self.alone = check.reduced.count(Slot.SDC_LOCAL) == 1
        return check.reduced.count(Slot.SDC_STOP) > 0

    def rerun_flags(self, step: int, reran: bool) -> dict[Slot, Any]:
        """This rank's verdict on its detection, after the rerun (or instead of it), as its slot's flag."""
        self.attributed = self.sdc.attribute(step, reran, alone=self.alone)
        return {slot: self.attributed == kind for kind, slot in VERDICT_SLOTS.items()}

    def after_rerun(self, step: int, rerun: Reduced, reran: bool) -> RerunOutcome:
        strongest = max((kind for kind, slot in VERDICT_SLOTS.items() if rerun.count(slot)),
                        default=RerunVerdict.NONE)
        verdicts = self._gather(int(self.attributed))  # the rare path: which ranks said what
        if self.rank == 0:
            said = {rank: RerunVerdict(v) for rank, v in enumerate(verdicts) if v}
            self.events.emit("sdc_rerun", step=step, verdict=strongest.label_after(reran), reran=reran,
                             ranks=list(said), verdicts={str(rank): v.label_after(reran) for rank, v in said.items()})
        return RerunOutcome(strongest, tuple(rank for rank, v in enumerate(verdicts) if v == RerunVerdict.FAULTY))

    def _gather(self, value: int) -> list[int]:
        if not dist.is_initialized():
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        return [int(part) for part in parts]
