"""One step sequence for both modes; what differs is the mode's ``StepEngine``.

``run_step`` is the step, the same for the closure mode (``step/skeleton.py``: ``ClosureStep``) and for live
mode (``live/worker.py``: ``LiveStep``), each step a fresh engine object holding that step's values:

1. ``begin``: the faults due at the step's start and the check of the state at rest (the closure mode's
   state plugin may end the step here: a ROLLBACK for a recompute, an ABORT for a struck-out device;
   live mode's replica fingerprints repair a replica instead);
2. ``compute``: zero the gradients, this rank's backward, and the step's one reduce carrying the norm, the
   loss and the plugins' flags (the closure mode's all-reduce of ``guards/step_slots``; live mode's
   order-fixed sum over the quorum, with its membership and stop flags beside); live mode ends the step
   here when a rank's computation raised (it is tried again);
3. ``integrity``: whether the computation can be trusted: SDC detection (``guards/plugins/sdc.SdcRerun``, in
   both modes), with its RERUN (the backward and the reduce again) carried out inside, answering APPLY, SKIP
   or ABORT (devices at their strike limit: the closure mode ends the run, live mode goes on and the struck-out
   ranks leave at the step's boundary);
4. ``gradient_judged``: the local norms of the gradient judged (``guards.local_norm``), and the rate the
   update uses, read before the scheduler steps;
5. ``update``: whether the update is applied, going on from the integrity decision: the update plugins
   (``guards/plugins/update.update_plugins``: data skip or rollback mode, a non-finite norm, the skip
   streak) through ``guards/step_verdict.decide``;
6. ``end_early`` on a ROLLBACK carried out (the run is back at the restored step) or an ABORT (raises);
7. ``apply`` (not on a SKIP): ``apply_update``: clip, the optimizer's step, the scheduler's;
8. ``commit``: the step's line and event (``events/step_report.StepReport``), the saves by policy, the
   heartbeat (and live mode's stop at this boundary, its epoch switch).

The helpers below are what both engines do alike inside their hooks: each phase's decision (``decide_step``),
the local norms' event, the update's rate and the update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch

from trainguard.guards.step_plugin import GuardPlugin, RerunJudge, StepCheck
from trainguard.guards.step_verdict import ENDS_THE_STEP, Decision, StepVerdict, decide
from trainguard.norms import clip_grads_, local_grad_norms

Emit = Callable[..., None]
Outcome = TypeVar("Outcome", covariant=True)


class StepEngine(Protocol[Outcome]):
    """One mode's part of one step, asked by ``run_step`` in its fixed order (see the module)."""

    def begin(self) -> Decision[GuardPlugin]:
        """The faults at the step's start and the check at rest; a decision that may end the step."""

    def compute(self) -> Outcome | None:
        """The backward and the step's one reduce; the step's outcome when it ends here, else None."""

    def integrity(self) -> Decision[GuardPlugin]:
        """Whether the computation can be trusted (a RERUN carried out inside)."""

    def gradient_judged(self) -> None:
        """The gradient is the one the update would use: its local norms, the update's rate."""

    def update(self, decided: Decision[GuardPlugin]) -> Decision[GuardPlugin]:
        """Whether the update is applied, going on from ``decided`` (the integrity decision)."""

    def end_early(self, decision: Decision[GuardPlugin]) -> Outcome:
        """A ROLLBACK carried out: the outcome at the restored step; an ABORT: raises."""

    def apply(self) -> None:
        """The update (``apply_update``)."""

    def commit(self, skipped: bool) -> Outcome:
        """The step done (applied, or ``skipped``): its report, the saves, the heartbeat."""


def run_step(engine: StepEngine[Outcome]) -> Outcome:
    """The step, in the order both modes share."""
    decision = engine.begin()
    if decision.verdict in ENDS_THE_STEP:
        return engine.end_early(decision)
    ended = engine.compute()
    if ended is not None:
        return ended
    decision = engine.integrity()
    if decision.verdict in ENDS_THE_STEP:
        return engine.end_early(decision)
    engine.gradient_judged()
    decision = engine.update(decision)
    if decision.verdict in ENDS_THE_STEP:
        return engine.end_early(decision)
    skipped = decision.verdict is StepVerdict.SKIP
    if not skipped:
        engine.apply()
    return engine.commit(skipped)


def decide_step(plugins: Sequence[GuardPlugin], check: Callable[[], StepCheck],
                rerun: Callable[[RerunJudge], StepVerdict],
                decided: Decision[GuardPlugin] | None = None) -> Decision[GuardPlugin]:
    """One phase's decision, the same in both modes: ``plugins`` asked in order through ``decide``, each with the
    step's ``check`` as it stands then (after a rerun, the rerun's sums); a RERUN carried out by the mode's
    ``rerun`` (the step computed and reduced again, judged by its plugin), a ROLLBACK by its plugin."""
    def carry_out(plugin: GuardPlugin, verdict: StepVerdict) -> StepVerdict:
        if verdict is StepVerdict.RERUN:
            return rerun(cast(RerunJudge, plugin))
        return plugin.roll_back(check())

    return decide(plugins, lambda plugin, so_far: plugin.verdict(check(), so_far), carry_out, decided)


def emit_local_norm(emit: Emit, step: int, model: torch.nn.Module) -> None:
    """``guards.local_norm``: this rank's norm of each parameter's gradient (its shard's), before clipping,
    as the ``local_norm`` event of ``step`` (the closure mode's number)."""
    emit("local_norm", step=step, norms=local_grad_norms(model.named_parameters()))


def update_lr(optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """The learning rate the next update uses (read before the scheduler steps)."""
    if scheduler is not None:
        return scheduler.get_last_lr()[0]
    return optimizer.param_groups[0]["lr"]


def apply_update(grads: list[torch.Tensor], grad_clip: float, global_norm: float, optimizer: torch.optim.Optimizer,
                 after_optimizer: Callable[[], None]) -> None:
    """An applied update: the gradients clipped to ``grad_clip`` (0: off) by the step's global norm, the
    optimizer's step, then ``after_optimizer`` (the scheduler's step and the mode's own record of it)."""
    clip_grads_(grads, grad_clip, global_norm)
    optimizer.step()
    after_optimizer()
