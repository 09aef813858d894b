"""SDC detection (``step/sdc.py``'s ``SdcGuard``) as a plugin: RERUN on a level-1 detection anywhere.

After the backward, a rank whose detection points saw a level-1 value raises ``SDC_STOP`` (and
``SDC_LOCAL`` when it was at a point it computed alone). When any rank raised it and
``guards.sdc.recover`` is on, the verdict is RERUN: the skeleton runs the step's backward again with
the RNGs and the data restored (unless ``guards.sdc.rerun`` is off: the step is then judged unverified),
each rank attributes its detection, and the rerun's all-reduce carries every rank's ``RerunVerdict``.
The strongest decides: a faulty device ends the run (ABORT, exit 17), a reproducible value skips the
step (SKIP), a transient fault keeps the rerun's gradients (APPLY).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.guards.step_plugin import Exclusion, GuardPlugin, StepCheck
from trainguard.guards.step_slots import Reduced, Slot
from trainguard.guards.step_verdict import StepVerdict
from trainguard.step.sdc import RerunVerdict, SdcGuard

# the slot each rank raises for its verdict after a rerun
VERDICT_SLOTS = {RerunVerdict.TRANSIENT: Slot.SDC_TRANSIENT, RerunVerdict.REPRODUCIBLE: Slot.SDC_REPRODUCIBLE,
                 RerunVerdict.FAULTY: Slot.SDC_FAULTY}

# what the step does after the rerun, by the strongest verdict of any rank
STEP_AFTER_RERUN = {RerunVerdict.NONE: StepVerdict.APPLY, RerunVerdict.TRANSIENT: StepVerdict.APPLY,
                    RerunVerdict.REPRODUCIBLE: StepVerdict.SKIP, RerunVerdict.FAULTY: StepVerdict.ABORT}


class SdcRerun(GuardPlugin):
    def __init__(self, sdc: SdcGuard, events: EventLog, rank: int, world_size: int, device: torch.device):
        self.sdc, self.events, self.rank, self.world_size, self.device = sdc, events, rank, world_size, device
        self.alone = False  # one rank only saw a level-1 value at a point it computed alone
        self.attributed = RerunVerdict.NONE  # this rank's verdict after the rerun
        self.exclusion: Exclusion | None = None  # the devices found faulty by the rerun

    @property
    def reruns_closure(self) -> bool:
        return self.sdc.config.rerun

    def flags(self, step: int) -> dict[Slot, Any]:
        detected = self.sdc.check(step)
        return {Slot.SDC_STOP: detected, Slot.SDC_LOCAL: detected and self.sdc.detected_locally}

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        if not (check.reduced.count(Slot.SDC_STOP) and self.sdc.config.recover):
            return StepVerdict.APPLY
        self.alone = check.reduced.count(Slot.SDC_LOCAL) == 1
        return StepVerdict.RERUN

    def rerun_flags(self, step: int, reran: bool) -> dict[Slot, Any]:
        """This rank's verdict on its detection, after the rerun (or instead of it), as its slot's flag."""
        self.attributed = self.sdc.attribute(step, reran, alone=self.alone)
        return {slot: self.attributed == kind for kind, slot in VERDICT_SLOTS.items()}

    def after_rerun(self, step: int, reduced: Reduced, reran: bool) -> StepVerdict:
        strongest = max((kind for kind, slot in VERDICT_SLOTS.items() if reduced.count(slot)),
                        default=RerunVerdict.NONE)
        verdicts = self._gather(int(self.attributed))  # the rare path: which ranks said what
        if self.rank == 0:
            said = {rank: RerunVerdict(v) for rank, v in enumerate(verdicts) if v}
            self.events.emit("sdc_rerun", step=step, verdict=strongest.label_after(reran), reran=reran,
                             ranks=list(said), verdicts={str(rank): v.label_after(reran) for rank, v in said.items()})
        if strongest == RerunVerdict.FAULTY:
            self.exclusion = Exclusion([rank for rank, v in enumerate(verdicts) if v == RerunVerdict.FAULTY],
                                       "SDC strikes", unapplied_step=step)
        return STEP_AFTER_RERUN[strongest]

    def abort_cause(self) -> Exclusion:
        return self.exclusion

    def _gather(self, value: int) -> list[int]:
        if not dist.is_initialized():
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        return [int(part) for part in parts]
