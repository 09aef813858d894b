"""What a guard plugin of the step skeleton is: its hooks, what it judges, and what it hands back.

A plugin (``guards/plugins/``, ``step/plugins/``) raises this rank's indicators for the step's one all-reduce (``flags``),
answers with a ``StepVerdict`` when the skeleton asks (``verdict``), and carries out what only it knows
how to: a rollback (``roll_back``), the cause of an abort (``abort_cause``). The skeleton asks a plugin
for ``roll_back`` or ``abort_cause`` only after that plugin answered ROLLBACK or ABORT; a RERUN is the
SDC plugin's alone (``RerunJudge``), since only the mode's engine can compute the step again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.errors import TrainguardError
from trainguard.guards.step_slots import Reduced, Slot
from trainguard.guards.step_verdict import StepVerdict


@dataclass(frozen=True)
class StepCheck:
    """What the plugins judge a step by."""

    step: int
    reduced: Reduced | None  # the world's sums of the step (after a rerun, the rerun's); None before the backward
    first_sample: int | None  # rollback mode: the data's global position when the step started


@dataclass(frozen=True)
class Restored:
    """A rollback carried out: the run is back at ``step``; the outcome reports ``loss`` and ``global_norm``."""

    step: int
    loss: float
    global_norm: float


@dataclass(frozen=True)
class Exclusion:
    """An abort for faulty devices: ``ranks`` reached their strike limit (exit 17, ``faulty_ranks.json``).
    The closure mode ends the run: ``unapplied_step``, the step whose computation found it, saved without
    its update (like a skipped step, its batch is not replayed); None: the run is saved where it is. Live
    mode goes on with the step, its update as ``update`` says (SKIP, or APPLY: an SDC rerun that found a
    transient fault and came back clean), and the ranks leave at the step's boundary, replaced."""

    ranks: list[int]
    evidence: str
    unapplied_step: int | None = None
    update: StepVerdict = StepVerdict.SKIP


class GuardPlugin:
    """One guard of the step. ``watches_every_step``: asked even after an earlier plugin decided."""

    watches_every_step = False

    def flags(self, step: int) -> dict[Slot, Any]:
        """This rank's indicators for the step's all-reduce, raised after the backward (none by default)."""
        return {}

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        """This guard's verdict on the step; ``decided``: the verdict so far (APPLY or SKIP)."""
        raise NotImplementedError

    def roll_back(self, check: StepCheck) -> StepVerdict:
        """After this plugin's ROLLBACK: restores the run (ROLLBACK, ``restored`` set), or finds nothing to
        restore (APPLY: the step goes on) or must end the run instead (ABORT)."""
        raise NotImplementedError

    restored: Restored  # set by a ``roll_back`` that answered ROLLBACK

    def abort_cause(self) -> TrainguardError | Exclusion:
        """After this plugin's ABORT: the error the run ends with, or the faulty devices to exclude first."""
        raise NotImplementedError


class RerunJudge(Protocol):
    """The plugin that asks for a RERUN: what a mode's engine needs from it to rerun the step and judge again.
    The flags and the reduce are the mode's: the closure mode's slots and ``Reduced``, live mode's flags of
    its order-fixed sum and its ``StepSum`` (None when it did not rerun)."""

    reruns_closure: bool  # the backward runs again (guards.sdc.rerun); else the step is judged unverified

    def rerun_flags(self, step: int, reran: bool) -> Any: ...

    def after_rerun(self, step: int, reduced: Any, reran: bool) -> StepVerdict: ...
