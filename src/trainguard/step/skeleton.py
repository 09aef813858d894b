"""The fixed step of the closure mode: the same sequence at every step, the guards plugged into it.

The sequence is the one both modes run (``guards/step_engine.run_step``); ``ClosureStep`` is the closure
mode's engine of it (live mode's: ``live/worker.LiveStep``):

1. the faults due at the step's start; the state plugin's at-rest check (a fingerprint step);
2. zero the gradients and run the backward (this rank's micro-batches, or the loop's closure);
3. one all-reduce of constant size: the global norm, the loss and every plugin's indicators
   (``guards/step_slots.py``);
4. ask the plugins for their ``StepVerdict`` (``guards/step_engine.decide_step``): first whether the computation
   can be trusted (state at rest, SDC: a RERUN runs the backward again and reduces again), then whether
   the update is applied (data skip, rollback mode, a non-finite norm, the skip streak);
5. act on the decision: ABORT ends the run (a faulty device: saved, ``faulty_ranks.json``, exit 17;
   too many spikes: exit 3), ROLLBACK returns the restored step, SKIP drops the update, APPLY clips,
   steps the optimizer and the scheduler (``guards/step_engine.apply_update``);
6. the step's log line and event, the saves by policy, the heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainguard.config.schema import RunConfig
from trainguard.guards.sdc import FaultyDeviceError, faulty_ranks_path, write_faulty_ranks
from trainguard.guards.step_engine import apply_update, decide_step, emit_local_norm, run_step
from trainguard.guards.step_plugin import Exclusion, GuardPlugin, RerunJudge, StepCheck
from trainguard.guards.step_slots import Reduced, Slot, local_slots, reduce_step
from trainguard.guards.step_verdict import Decision, StepVerdict
from trainguard.step.builder import GuardParts, StepPlugins
from trainguard.step.position import RunPosition
from trainguard.events.step_report import StepReport
from trainguard.step.saving import StepSaves
from trainguard.step.snapshot import StepSnapshot


@dataclass(frozen=True)
class StepOutcome:
    step: int  # the step the run is at now: this one, or after a rollback the restored one
    loss: float  # the step's loss, averaged over the loss-holding ranks
    global_norm: float  # the true global gradient norm before clipping
    applied: bool  # the optimizer and scheduler stepped
    skipped: bool  # the update was dropped (a spike, or an SDC detection that came back on the rerun)
    rolled_back: bool  # a spike restored an earlier checkpoint (rollback mode)


class ClosureStep:
    """The closure mode's ``StepEngine`` (``guards/step_engine.run_step``): one step in progress, what a
    RERUN replaces (the loss, the reduced scalars) and what it restores."""

    def __init__(self, skeleton: StepSkeleton, closure: Callable[[], Any],
                 batch_samples: list[tuple[int, int]] | None):
        parts = skeleton.parts
        self.skeleton, self.parts, self.plugins = skeleton, parts, skeleton.plugins
        self.started = time.perf_counter()
        self.step = skeleton.position.step + 1
        self.closure, self.batch_samples = closure, batch_samples
        self.first_sample = parts.data.consumed_samples if parts.data is not None else None
        self.snapshot: StepSnapshot | None = None
        self.loss: Any = None
        self.reduced: Reduced | None = None
        self.lr = 0.0  # the rate the update uses (``gradient_judged``)

    @property
    def check(self) -> StepCheck:
        return StepCheck(self.step, self.reduced, self.first_sample)

    def begin(self) -> Decision[GuardPlugin]:
        skeleton, parts, step = self.skeleton, self.parts, self.step
        parts.faults.at_step_start(step)
        parts.faults.at_rest(step, skeleton.model, skeleton.optimizer, parts.checkpoints.wait_for_staging)
        return self.decide(self.plugins.before_backward)

    def compute(self) -> None:
        parts, step = self.parts, self.step
        self.snapshot = StepSnapshot.take(parts.stateful) if parts.sdc is not None else None
        self.loss = self.skeleton.forward_backward(self.closure, step)
        flags: dict[Slot, Any] = {}
        for plugin in self.plugins.integrity:
            flags.update(plugin.flags(step))
        self.reduced = self.skeleton.reduce(self.loss, flags)

    def integrity(self) -> Decision[GuardPlugin]:
        return self.decide(self.plugins.integrity)

    def gradient_judged(self) -> None:
        skeleton = self.skeleton
        if skeleton.config.guards.local_norm:
            emit_local_norm(self.parts.events.emit, self.step, skeleton.model)
        self.lr = skeleton.saves.lr()  # before the scheduler steps: the rate this step's update uses

    def update(self, decided: Decision[GuardPlugin]) -> Decision[GuardPlugin]:
        return self.decide(self.plugins.update, decided)

    def end_early(self, decision: Decision[GuardPlugin]) -> StepOutcome:
        return self.skeleton.end_early(decision)

    def apply(self) -> None:
        skeleton = self.skeleton
        self.parts.checkpoints.wait_for_staging()  # a save's copy ran during this forward and backward
        apply_update(skeleton.grads(), skeleton.config.optim.grad_clip, self.reduced.global_norm, skeleton.optimizer,
                     self.after_optimizer)

    def after_optimizer(self) -> None:
        if self.skeleton.scheduler is not None:
            self.skeleton.scheduler.step()
        self.parts.state.after_update(self.step)

    def commit(self, skipped: bool) -> StepOutcome:
        skeleton, parts, position, step, reduced = self.skeleton, self.parts, self.skeleton.position, self.step, self.reduced
        position.step = step
        position.last_loss = reduced.loss
        samples = (parts.data.ranges_between(self.first_sample, parts.data.consumed_samples)
                   if parts.data is not None else self.batch_samples)
        seconds = time.perf_counter() - self.started
        parts.lifecycle.note_step(seconds)
        if parts.rank == 0:
            skeleton.report(StepReport(
                step, position.total, reduced.loss, reduced.global_norm, self.lr, seconds, skipped,
                skeleton.tokens_per_step, parts.skips.totals(),
                parts.embedding.local() if parts.embedding is not None else None, samples))
        skeleton.saves.by_policy(step)
        parts.lifecycle.beat("step", step)
        return StepOutcome(step, reduced.loss, reduced.global_norm, applied=not skipped, skipped=skipped,
                           rolled_back=False)

    def decide(self, plugins: list[GuardPlugin], decided: Decision[GuardPlugin] | None = None
               ) -> Decision[GuardPlugin]:
        return decide_step(plugins, lambda: self.check, self.rerun, decided)

    def rerun(self, judge: RerunJudge) -> StepVerdict:
        """The backward again on the same inputs (RNGs and data restored), after a level-1 SDC detection
        somewhere (with ``guards.sdc.rerun`` off, the step is judged unverified without it), and its
        all-reduce, which carries every rank's verdict on its detection; the verdict that stands."""
        reran = judge.reruns_closure
        if reran:
            self.snapshot.restore(self.parts.stateful)
            self.loss = self.skeleton.forward_backward(self.closure, self.step)
        self.reduced = self.skeleton.reduce(self.loss, judge.rerun_flags(self.step, reran))
        return judge.after_rerun(self.step, self.reduced, reran)


class StepSkeleton:
    def __init__(self, parts: GuardParts, plugins: StepPlugins, config: RunConfig, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, position: RunPosition, saves: StepSaves,
                 tokens_per_step: int | None):
        self.parts, self.plugins, self.config = parts, plugins, config
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.position, self.saves, self.tokens_per_step = position, saves, tokens_per_step

    def run(self, closure: Callable[[], Any], batch_samples: list[tuple[int, int]] | None = None) -> StepOutcome:
        return run_step(ClosureStep(self, closure, batch_samples))

    # ---------------------------------------------------------------------------------- verdicts
    def end_early(self, decision: Decision[GuardPlugin]) -> StepOutcome:
        """A ROLLBACK carried out (the run is back at the restored step) or an ABORT (raises)."""
        plugin = decision.by
        if decision.verdict is StepVerdict.ABORT:
            cause = plugin.abort_cause()
            if isinstance(cause, Exclusion):
                self._exclude(cause)
            raise cause
        restored = plugin.restored
        self.position.step = restored.step
        self.parts.state.after_update(restored.step)  # the next step is checked against the state loaded
        self._forget_measurements()
        return StepOutcome(restored.step, restored.loss, restored.global_norm, applied=False, skipped=False,
                           rolled_back=True)

    def _exclude(self, exclusion: Exclusion) -> NoReturn:
        """Ranks whose device reached its strike limit: saves the step the run is at (unless it is saved),
        writes ``faulty_ranks.json`` (each faulty rank its entry) and ends the run on every rank with exit 17."""
        parts = self.parts
        if exclusion.unapplied_step is not None:
            # saved as step N without N's update: like a skipped step, its batch is not replayed
            self.position.step = exclusion.unapplied_step
            self._forget_measurements()
        step = self.position.step
        if step > 0 and parts.checkpoints.last_saved_step != step:
            parts.checkpoints.save(step, self.saves.trainer_state(), self.saves.health, stopping=True)
        parts.checkpoints.close()
        run_dir = parts.run_dir
        if parts.rank in exclusion.ranks:
            write_faulty_ranks(faulty_ranks_path(run_dir), parts.sdc.strikes.faulty_entries())
        if dist.is_initialized():
            dist.barrier()
        raise FaultyDeviceError(f"faulty hardware: rank(s) {exclusion.ranks} reached {parts.sdc.config.strikes} "
                                f"strikes ({exclusion.evidence}); see {faulty_ranks_path(run_dir)}")

    def _forget_measurements(self) -> None:
        """No step measured since (a rollback, a step saved without its update): the embedding norm
        judges no save."""
        if self.parts.embedding is not None:
            self.parts.embedding.forget()

    # ----------------------------------------------------------------------- backward and reduce
    def forward_backward(self, closure: Callable[[], Any], step: int) -> Any:
        self.optimizer.zero_grad(set_to_none=True)
        if self.parts.sdc is not None:
            self.parts.sdc.begin_pass()
        loss = closure()
        self.parts.faults.after_backward(step, self.model)
        if self.parts.embedding is not None:
            self.parts.embedding.measure()  # before clipping
        return loss

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def reduce(self, loss: Any, flags: dict[Slot, Any]) -> Reduced:
        """One all-reduce: the global norm, the mean loss, the count of ranks raising each flag."""
        parts = self.parts
        share = None
        if loss is not None:  # the loss-holding ranks of a stage: its dp ranks (different data) × tp ranks
            share = torch.as_tensor(loss, dtype=torch.float64, device=parts.device).detach() / parts.ranks_per_stage
        return reduce_step(self.grads(), local_slots(parts.device, share, flags), parts.ranks_per_stage,
                           known=parts.sdc.take_gradient_norms() if parts.sdc is not None else ())

    def report(self, report: StepReport) -> None:
        report.log_to(self.parts.log, self.config.train.log_interval)
        self.parts.events.emit("step", **report.event_fields())
