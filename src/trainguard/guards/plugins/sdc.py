"""SDC detection as a plugin of the step, the same decision in both modes: RERUN on a level-1 detection
anywhere, then APPLY, SKIP or ABORT by the strongest verdict of any rank.

When any rank saw a level-1 value and ``guards.sdc.recover`` is on, the verdict is RERUN: the mode's engine
recomputes the step with the same inputs (unless ``guards.sdc.rerun`` is off: the step is then judged
unverified) and reduces again, carrying what ``rerun_flags`` gives; each rank's detector attributes its
detection, and the strongest verdict decides: a transient fault keeps the rerun's gradients (APPLY), a
reproducible value skips the step (SKIP), a device at its strike limit is excluded (ABORT with an
``Exclusion``, whose reaction is the mode's: the closure mode saves the step without its update and ends
the run, exit 17; live mode goes on with the step and the struck-out ranks leave at its boundary).

What differs between the modes is how every rank learns the same thing, and that is the plugin's inputs
(``SdcVotes``): the closure mode's detections raise counts of the step's all-reduce and its verdicts ride
in the rerun's (``step/plugins/sdc.ClosureSdcVotes``); live mode judges values every member holds alike
after the order-fixed sum, agreed by construction (``live/sdc.LiveSdcVotes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.guards.sdc import RerunVerdict, SdcConfig
from trainguard.guards.step_plugin import Exclusion, GuardPlugin, StepCheck
from trainguard.guards.step_slots import Slot
from trainguard.guards.step_verdict import StepVerdict

# what the step does after the rerun, by the strongest verdict of any rank
STEP_AFTER_RERUN = {RerunVerdict.NONE: StepVerdict.APPLY, RerunVerdict.TRANSIENT: StepVerdict.APPLY,
                    RerunVerdict.REPRODUCIBLE: StepVerdict.SKIP, RerunVerdict.FAULTY: StepVerdict.ABORT}


@dataclass(frozen=True)
class RerunOutcome:
    """What every rank knows after the rerun (or instead of it), through its mode's collectives."""

    strongest: RerunVerdict  # the strongest verdict of any rank: it decides the step (``STEP_AFTER_RERUN``)
    faulty: tuple[int, ...] = ()  # FAULTY: the ranks that reached their strike limit
    # FAULTY: the step's update apart from the strikes (APPLY: a transient fault whose rerun is clean), the
    # ``Exclusion``'s ``update``
    update: StepVerdict = StepVerdict.SKIP


class SdcVotes(Protocol):
    """One mode's SDC detection as the plugin's inputs: this rank's detectors, and what the mode's collectives
    (or its values agreed by construction) tell every rank alike."""

    @property
    def config(self) -> SdcConfig: ...

    def flags(self, step: int) -> dict[Slot, Any]:
        """This rank's indicators for the step's reduce (none where the values ride elsewhere)."""

    def detected(self, check: StepCheck) -> bool:
        """Whether any rank saw a level-1 value at the step."""

    def rerun_flags(self, step: int, reran: bool) -> Any:
        """This rank's part of the rerun's reduce."""

    def after_rerun(self, step: int, rerun: Any, reran: bool) -> RerunOutcome:
        """Every rank's verdict on its detection, from the rerun's reduce (``reran`` False: none was run)."""


class SdcRerun(GuardPlugin):
    def __init__(self, votes: SdcVotes):
        self.votes = votes
        self.exclusion: Exclusion | None = None  # the devices found faulty by the rerun

    @property
    def reruns_closure(self) -> bool:
        return self.votes.config.rerun

    def flags(self, step: int) -> dict[Slot, Any]:
        return self.votes.flags(step)

    def verdict(self, check: StepCheck, decided: StepVerdict) -> StepVerdict:
        if not (self.votes.detected(check) and self.votes.config.recover):
            return StepVerdict.APPLY
        return StepVerdict.RERUN

    def rerun_flags(self, step: int, reran: bool) -> Any:
        return self.votes.rerun_flags(step, reran)

    def after_rerun(self, step: int, reduced: Any, reran: bool) -> StepVerdict:
        outcome = self.votes.after_rerun(step, reduced, reran)
        verdict = STEP_AFTER_RERUN[outcome.strongest]
        if verdict is StepVerdict.ABORT:
            self.exclusion = Exclusion(list(outcome.faulty), "SDC strikes", unapplied_step=step,
                                       update=outcome.update)
        return verdict

    def abort_cause(self) -> Exclusion:
        return self.exclusion
