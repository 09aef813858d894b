"""One rank of a live-recovery run: steps with its epoch's quorum, survives a peer's death without
restarting, and (as a replacement or an excluded survivor) rejoins at a step boundary.

The model, the optimizer and the loss of one micro-batch are the user's (``trainguard.live.rank.LiveRank``,
the engine of ``trainguard.Guard``'s live mode, hands them in; the drill's ``workload`` is one such
user); the rank's place in the run comes from the launcher's arguments (``LiveArgs``).

Each step (``LiveStep``, live mode's engine of the step sequence both modes run, ``guards/step_engine.run_step``):
compute this member's micro-batches, their fixed-order sum over the quorum (both asked of the
rank's parameter layout, chosen once, ``live/layout.py``: whole replicas, one all-reduce of a row per
micro-batch; our own row shards, gathered whole around the step, and the group reduce-scatter plus
cross-group sum of ``group_reduce``; FSDP2 over the replica group's mesh, one reduce-scatter per group
share), which also carries the step's loss, the "a newer epoch exists" flag,
each rank's stop reasons (the lifecycle's: kill switch, signal, time limit) and each micro-batch's SDC
detection values, keep the state of before the update (the one step a survivor may have to
undo, below), judge the summed gradient with the closure mode's update plugins and precedence (``step_judge``: data
skip, a non-finite norm, the skip streak; the drill's gradient faults first; SDC detection with its rerun,
the closure mode's plugin, on values every member holds alike after the sum, ``live/sdc.py``), apply the
update unless it is skipped, and stop at this boundary with a durable save if any rank saw a reason, or at
``train.exit_at_step``. A failed collective means the epoch is over: the rank reports
the last step it committed and waits for the lighthouse's next epoch. A member that finished the
failed step while another did not undoes it (the lighthouse starts the new epoch at the smallest
committed step); the redone step is bitwise the same, so nothing is counted twice. A rank left out of
the new epoch (its replica group lost a rank) asks to join and receives the state from a live peer
when the survivors reach the next step boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import Stateful
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.checkpoint.spike_rollback import SpikeRollback
from trainguard.checkpoint.staging import serialised
from trainguard.errors import EXIT_OK, RestoreFailed, raised_by_every_rank
from trainguard.events import EventLog
from trainguard.events.rank_logging import LOGGER_NAME
from trainguard.events.step_report import StepReport
from trainguard.faults import FaultInjector
from trainguard.faults.spec import FaultSpec
from trainguard.fs.fsio import atomic_write_bytes
from trainguard.guards.fingerprint import FingerprintConfig, restore_agreeing
from trainguard.guards.health import HealthConfig, save_health
from trainguard.guards.rollback import RollbackAbort, RollbackConfig, RollbackGuard
from trainguard.guards.sdc import SdcConfig
from trainguard.guards.skip import DataSkipAbort, SkipConfig
from trainguard.guards.skip_streak import DEFAULT_MAX_CONSECUTIVE_SKIPS
from trainguard.guards.plugins.sdc import SdcRerun
from trainguard.guards.step_engine import apply_update, decide_step, emit_local_norm, run_step, update_lr
from trainguard.guards.step_plugin import GuardPlugin, RerunJudge, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_verdict import Decision, StepVerdict
from trainguard.live import collective
from trainguard.live.data_positions import DataPositions
from trainguard.live.durable import LiveCheckpoints
from trainguard.live.group_reduce import Exchange, SlotLayout, StepSum
from trainguard.live.layout_build import build_layout
from trainguard.live.local_tier import LiveLocalTier
from trainguard.live.micro_batch import MicroBatchLoss, StepWork
from trainguard.live.quorum import (NO_STATE, STOP, STOPPED, Quorum, awaited_at_end, beat_key, done_key, entered_key,
                                    epoch_key, fence_key, has, latest_epoch, progress_key, read_quorum, ready_key,
                                    report_key, start_key, wait_for)
from trainguard.live.probe import PeerProbe
from trainguard.live.shards import shard_of
from trainguard.live.sharded_params import norm_by_rows
from trainguard.live.stall import ReduceMarks
from trainguard.live.fingerprint import LiveFingerprints
from trainguard.live.sdc import LiveSdc, LiveSdcVotes
from trainguard.live.state import LiveState
from trainguard.live.load_failures import NothingToRestore
from trainguard.live.step_failures import STEP_FAILURE, StepFailed, StepFailures, StepFailureVerdict
from trainguard.live.step_judge import LiveJudge, live_check
from trainguard.live.transfer import send_shards
from trainguard.live.files import checkpoint_path, events_path, final_path
from trainguard.runtime.heartbeat import node_name
from trainguard.runtime.lifecycle import (DEADLINE, EXIT_CODES, KILL_SWITCH, NONE, REASON_NAMES, SIGNAL, Lifecycle,
                                          LifecycleConfig)
from trainguard.runtime.outcome import RunOutcome, stop_outcome

FENCED_EXIT = 3  # a stale process that found itself fenced ends with this code

T = TypeVar("T")
WAIT_S = 120.0  # the longest a rank waits for the lighthouse (a new epoch, a join's start step)
BEAT_S = 0.05  # the most often a rank raises its heartbeat counter
STOP_REASONS = (DEADLINE, SIGNAL, KILL_SWITCH)  # each one a count in the step's all-reduce; the strongest wins


# the sample range ``[first, end)`` of micro-batch ``m`` of step ``t``, for the events' sample check
SampleRange = Callable[[int, int], tuple[int, int]]


class Fenced(Exception):
    """This process's rank was declared dead and replaced: it must stop, not rejoin."""


@dataclass(frozen=True)
class LiveArgs:
    """What the launcher tells a rank (``launcher._spawn`` writes these flags)."""
    store: str  # HOST:PORT of the launcher's TCPStore
    rank: int | None
    spare: int | None  # a warm spare: waits (torch imported) to be told which rank to replace
    world: int
    group_size: int  # ranks per replica group: each one a shard of the parameters (``sharded_params``)
    steps: int
    run_dir: Path
    micro_batches: int  # per step (the global batch), whatever the number of live ranks
    micro_batch_s: float  # drill: simulated compute per micro-batch
    checkpoint_every: int
    collective_timeout_s: float
    rejoin: bool
    fail_after_reduce: int | None  # drill: treat this step's all-reduce as failed here, once
    doctor: bool  # a spare: self-test before saying it is ready (``spare_check``)
    doctor_faults: str | None  # drill: ``miscompute`` entries for the spares' self-tests
    stall_collective: int | None  # drill: stay out of this step's all-reduce, alive, until the epoch ends
    stall_cut: bool  # drill: ... marked as in it, with this rank's probe socket closed (live/stall.py)
    resume: Path | None  # the durable checkpoint the job resumes from (the launcher chose it), or None
    lifeline: bool = False  # started on another node: the launcher ends this process through stdin (lifeline.py)
    fsdp: bool = False  # fault_tolerance.fsdp: the script shards its model over the replica group's mesh
    tp: int = 1  # parallel.tp: ranks of a group at one dp_shard position (tp fastest), reading the same micro-batches

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> LiveArgs:
        """The launcher's flags in ``argv``; the others (the user's own flags) are left alone."""
        parser = argparse.ArgumentParser(description="a rank of a live-recovery run (trainguard.live.launcher)")
        parser.add_argument("--store", required=True)
        role = parser.add_mutually_exclusive_group(required=True)
        role.add_argument("--rank", type=int)
        role.add_argument("--spare", type=int)
        parser.add_argument("--world", type=int, required=True)
        parser.add_argument("--group-size", type=int, default=1)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--run-dir", type=Path, required=True)
        parser.add_argument("--micro-batches", type=int, required=True)
        parser.add_argument("--micro-batch-s", type=float, default=0.0)
        parser.add_argument("--checkpoint-every", type=int, default=0)
        parser.add_argument("--collective-timeout-s", type=float, default=30.0)
        parser.add_argument("--rejoin", action="store_true")
        parser.add_argument("--fail-after-reduce", type=int)
        parser.add_argument("--doctor", action="store_true")
        parser.add_argument("--doctor-faults")
        parser.add_argument("--stall-collective", type=int)
        parser.add_argument("--stall-cut", action="store_true")
        parser.add_argument("--resume", type=Path)
        parser.add_argument("--lifeline", action="store_true")
        parser.add_argument("--fsdp", action="store_true")
        parser.add_argument("--tp", type=int, default=1)
        known, _ = parser.parse_known_args(argv)
        return cls(**vars(known))


@dataclass(frozen=True)
class LiveRules:
    """What a live step does besides the sum and the update, from the run configuration (``Guard``'s live
    mode; the drill's workload runs the defaults)."""
    grad_clip: float = 0.0  # optim.grad_clip (0: off), as the closure mode clips
    skip: SkipConfig = field(default_factory=SkipConfig)  # guards.skip: the data-skip rule
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS  # guards.max_consecutive_skips
    gradient_faults: tuple[FaultSpec, ...] = ()  # the drill's spike/nan entries (``live.drill.gradient_faults``)
    # the drill's bitflip/scale/stateflip/hang entries (``live.drill.site_faults``): one rank's own, once
    site_faults: tuple[FaultSpec, ...] = ()
    sdc: SdcConfig = field(default_factory=SdcConfig)  # guards.sdc, its environment applied (live/sdc.py)
    fingerprint: FingerprintConfig = field(  # guards.fingerprint (live/fingerprint.py); the drill's workload: off
        default_factory=lambda: FingerprintConfig(interval=0))
    exit_at_step: int | None = None  # train.exit_at_step: save and exit 0 once this many steps are committed
    health: HealthConfig = field(default_factory=HealthConfig)  # guards.health: each durable save's verdict
    monitor: bool = False  # guards.monitor: the embedding's gradient norm in every live_step event
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)  # the kill switch, the time limit
    ranks_per_node: int | None = None  # parallel.ranks_per_node: the {node} of the local tiers' directories (None: one)
    # fault_tolerance.max_step_failures: a step whose computation raised is tried this many times in a
    # row before the run ends (live/step_failures.py)
    max_step_failures: int = 3
    # guards.rollback when guards.check_for_global_norm is on (rollback mode: ``live/data_positions.py``), else None
    rollback: RollbackConfig | None = None
    local_norm: bool = False  # guards.local_norm: each rank's per-parameter norms of its gradient shard, each step
    # train.log_interval: the quorum's first member writes the closure mode's step line every this many steps
    log_interval: int = 1
    tokens_per_step: int | None = None  # Guard(tokens_per_step=...): the global tokens of one step, for tokens/s


# the drill's workload's: no clipping, no data skip, the skip streak's default, a step line every 10 steps
DEFAULT_RULES = LiveRules(log_interval=10)


@dataclass(frozen=True)
class CommittedStep:
    """What ``LiveWorker.step`` committed: the step's index (from 0), its loss (the mean over the global
    batch), its global norm before clipping, whether the guards skipped its update, and the embedding's
    gradient norm (``guards.health``, ``guards.monitor``; None when neither is on). After a rollback
    (``rolled_back``) the index is the restored step's last, its loss and norm the spike's."""
    index: int
    loss: float
    global_norm: float
    skipped: bool
    embedding_norm: float | None = None
    rolled_back: bool = False


@dataclass(frozen=True)
class LiveStop:
    """The quorum's agreed stop at a step boundary, saved first: why, and the process's exit code."""
    step: int  # the committed steps
    reason: str  # ``lifecycle.REASON_NAMES``' name, or "exit_at_step"
    message: str
    exit_code: int


APPLY = Decision(StepVerdict.APPLY, None)


class LiveStep:
    """Live mode's ``StepEngine`` (``guards/step_engine.run_step``, the closure mode's sequence): one step of a
    ``LiveWorker`` in its epoch, whether it committed (not when a rank's computation of it raised). Its
    membership and its order-fixed reduction are the parts that differ:

    - ``begin``: the drill's state fault between steps, and replica fingerprints' check (``check_replicas``),
      which repairs and strikes a replica before it computes, and ends the step as a rollback (``end_early``)
      when what no replica can repair is recomputed from a durable checkpoint;
    - ``compute``: this member's micro-batches by the parameter layout (``live/layout.py``), and the step's one sum
      over the quorum, carrying beside the gradient the step's loss, the "a newer epoch exists" flag, each rank's
      stop reasons and whether its computation raised (then the step ends here, tried again:
      ``live/step_failures.py``); then the undo point (the one step a survivor may have to undo), the drill's
      gradient faults, the norm by rows;
    - ``integrity``: the closure mode's SDC plugin (``guards/plugins/sdc.SdcRerun``) through the same
      ``decide_step``, its inputs the sum's extras (``live/sdc.LiveSdcVotes``), its RERUN carried out by ``rerun``
      (the same micro-batches, the same sum); its ABORT with an exclusion (devices at their strike limit) is
      not the end of the run here: the step goes on with the exclusion's update (APPLY or SKIP), and the
      excluded ranks leave at the step boundary, after the save, replaced;
    - ``update``: the closure mode's update plugins through ``decide_step`` (``live/step_judge.py``);
    - ``end_early``: an abort on every member (exit 3), or a rollback to the quorum's durable checkpoint (rollback
      mode's, or replica fingerprints' recompute);
    - ``commit``: the step's line and ``live_step`` event, the committed step recorded for the loop, the progress
      key, the quorum's agreed stop or the durable save, the drill's checkpoint, a struck-out device's exit, and
      the switch to a newer epoch (a joiner's state sent at this boundary).

    A failed collective raises out of any hook (``LiveWorker.train`` recovers); a hook that has changed the
    state by then (a judged SDC detector, a rollback's restore) undoes it first.
    """

    def __init__(self, worker: LiveWorker):
        self.worker = worker
        self.quorum, self.step = worker.quorum, worker.step_index
        self.number = self.step + 1  # the step as the closure mode numbers it: the guards' and the faults' step
        self.started = time.perf_counter()
        self.exchange = Exchange(self.quorum.members, worker.rank, worker.slots)
        self.mine = worker.layout.my_micro_batches(self.exchange)
        self.newer_seen = False  # a newer epoch exists (a join): switched to at this boundary
        self.stops_seen: list[int] = []  # the ranks raising each of ``STOP_REASONS``
        self.summed: StepSum | None = None  # the step's sum (``compute``)
        self.loss = 0.0
        self.grads: list[torch.Tensor] = []
        self.norm, self.embedding_norm = 0.0, None
        self.again: StepSum | None = None  # SDC detection's rerun's sum
        self.struck_out: tuple[int, ...] = ()  # the ranks SDC detection excluded: they leave at this boundary
        self.lr = 0.0

    def begin(self) -> Decision[GuardPlugin]:
        worker = self.worker
        worker.site_faults.at_rest(self.number, worker.model, worker.optimizer)  # the drill's stateflip, between steps
        if worker.fingerprints is not None and worker.fingerprints.due(self.number) and \
                worker.check_replicas(self.quorum, self.step):
            # recomputing from a checkpoint: the step ends as after a rollback, the loop goes on from its step
            return Decision(StepVerdict.ROLLBACK, worker.fingerprints)
        return APPLY

    def compute(self) -> bool | None:
        worker, quorum, step, mine = self.worker, self.quorum, self.step, self.mine
        if worker.layout.marks_span_step:
            # the stall watch's marks span the step's collectives, from the first (the unshard, or FSDP2's first
            # all-gather) to the norm's
            worker.reduce_marks.entering(quorum.epoch, step, worker.beat)
        computed, extras, failure = worker.compute(step, self.exchange, mine, catch=True)
        if failure is not None:  # before the sum: the reporter reads it once the sum says a rank failed
            worker.store.set(STEP_FAILURE, f"rank {worker.rank}: {failure}")
        if worker.sample_range:
            # before the sum, not after: a rank killed once its rows are in the sum, before it could say
            # so, leaves the step committed by the others with its samples in it
            position = worker.data_position(step)
            worker.events.emit("live_samples", step=step, epoch=quorum.epoch, members=len(quorum.members),
                               micro_batches=mine, samples=[worker.sample_range(position, m) for m in mine])
        newer = latest_epoch(worker.store) > quorum.epoch
        reason = worker.stop_reason()
        flags = [int(newer), *(int(reason == r) for r in STOP_REASONS), int(failure is not None)]
        if not worker.layout.marks_span_step:
            worker.reduce_marks.entering(quorum.epoch, step, worker.beat)
        summed = worker.reduce(self.exchange, computed, flags, extras)
        newer_seen, *self.stops_seen, failed = summed.flags
        self.newer_seen = bool(newer_seen)
        if failed:
            worker.reduce_marks.left(quorum.epoch, step)
            if self.stop_reason() != NONE:  # asked to stop while the step keeps failing: at the committed step
                worker.stop_here(self.stop_reason())
            else:
                worker.step_failed(step, failed)
            return False
        self.loss = summed.loss
        if step == worker.fail_after_reduce:
            worker.fail_after_reduce = None
            worker.await_peers_committed(step)
            raise RuntimeError(f"injected: rank {worker.rank}'s collective of step {step} failed after the others' "
                               "succeeded")
        worker.previous = (step, worker.state.undo_point())
        worker.faults.after_backward(self.number, worker.model)
        self.take_norms()
        self.summed = summed
        return None

    def take_norms(self) -> None:
        self.grads = [p.grad for p in self.worker.model.parameters() if p.grad is not None]
        self.norm, self.embedding_norm = self.worker.norms(self.grads)

    @contextmanager
    def undone_if_the_epoch_fails(self) -> Iterator[None]:
        """A failed collective inside (the rerun's sum, a rollback's restore) after this rank's guards judged
        the step: this rank redoes the step from before it."""
        try:
            yield
        except RuntimeError:
            self.worker.state.undo(self.worker.previous[1])
            self.worker.state_in_doubt = False
            raise

    @property
    def check(self) -> StepCheck:
        return live_check(self.number, self.norm, self.loss)

    def integrity(self) -> Decision[GuardPlugin]:
        worker = self.worker
        decision = APPLY
        if worker.sdc is not None:
            sdc = SdcRerun(LiveSdcVotes(worker.sdc, worker.layout.computed_by(self.exchange), self.summed))
            with self.undone_if_the_epoch_fails():
                decision = decide_step([sdc], lambda: self.check, self.rerun)
            if decision.verdict is StepVerdict.ABORT:  # devices at their strike limit: they leave at the boundary
                exclusion = sdc.abort_cause()
                self.struck_out = tuple(exclusion.ranks)
                decision = APPLY if exclusion.update is StepVerdict.APPLY else Decision(exclusion.update, sdc)
        if self.again is not None and decision.verdict is StepVerdict.APPLY:
            # a transient fault: the step goes on with the rerun's sum, whose gradients ``rerun`` set
            self.loss = self.again.loss
            self.take_norms()
        worker.reduce_marks.left(self.quorum.epoch, self.step)
        return decision

    def rerun(self, judge: RerunJudge) -> StepVerdict:
        """SDC detection's rerun (``LiveWorker.rerun``: the same micro-batches, the same sum, its flags the
        judge's); with ``guards.sdc.rerun`` off the step is judged unverified without it."""
        reran = judge.reruns_closure
        if reran:
            self.again = self.worker.rerun(self.step, self.exchange, self.mine, judge.rerun_flags(self.number, reran))
        return judge.after_rerun(self.number, self.again, reran)

    def gradient_judged(self) -> None:
        worker = self.worker
        if worker.rules.local_norm:  # the gradient judged, before clipping, as the closure mode's event
            emit_local_norm(worker.events.emit, self.number, worker.model)
        self.lr = update_lr(worker.optimizer, worker.state.scheduler)  # before the scheduler steps

    def update(self, decided: Decision[GuardPlugin]) -> Decision[GuardPlugin]:
        # every rank's alike: the same sum, the same state
        with self.undone_if_the_epoch_fails():  # a rollback's restore failed with the epoch
            return self.worker.judge.judge(self.number, self.norm, self.loss, decided)

    def end_early(self, decision: Decision[GuardPlugin]) -> bool:
        worker = self.worker
        if decision.verdict is StepVerdict.ABORT:  # every member judged the same sum: all end at this step
            worker.aborted(self.step, decision.by.abort_cause())
        restored = decision.by.restored  # every member restored the same checkpoint
        worker.rolled_back(restored.step, restored.loss, restored.global_norm)
        if self.newer_seen:
            worker.switch(self.quorum.epoch + 1)
        return True

    def apply(self) -> None:  # a sharded rank steps its own rows: they stay sharded
        worker = self.worker
        apply_update(self.grads, worker.rules.grad_clip, self.norm, worker.optimizer, worker.state.after_update)

    def commit(self, skipped: bool) -> bool:
        worker, quorum, step = self.worker, self.quorum, self.step
        seconds = time.perf_counter() - self.started
        report = StepReport(self.number, worker.steps, self.loss, self.norm, self.lr, seconds, skipped,
                            worker.rules.tokens_per_step, worker.judge.skips.totals(), self.embedding_norm)
        if worker.reports():
            report.log_to(worker.log, worker.rules.log_interval)
        fields = {key: value for key, value in report.event_fields().items() if key != "step"}  # live_step's counts from 0
        worker.events.emit("live_step", step=step, epoch=quorum.epoch, members=len(quorum.members),
                           micro_batches=self.mine, **fields)
        worker.state.committed = dataclasses.asdict(CommittedStep(step, self.loss, self.norm, skipped,
                                                                  self.embedding_norm))
        worker.step_failures.committed()
        worker.step_index = step + 1
        if worker.fingerprints is not None:
            worker.fingerprints.remember(worker.step_index + 1)
        worker.store.set(progress_key(worker.rank), str(worker.step_index))
        if worker.lifecycle is not None:
            worker.lifecycle.note_step(seconds)
        self.stop_or_save()
        if (worker.checkpoint_every and worker.step_index % worker.checkpoint_every == 0
                and quorum.index(worker.rank) < worker.group_size):  # the lowest live group's shards
            path = checkpoint_path(worker.run_dir, worker.step_index, worker.shard)
            path.parent.mkdir(exist_ok=True)
            atomic_write_bytes(path, serialised(worker.state.state_dict()))
        # saved first (the check before the save may have struck a rank too): its group leaves, the others go on
        worker.leave_if_struck_out(self.struck_out + (worker.fingerprints.take_struck_out()
                                                      if worker.fingerprints is not None else ()))
        if self.newer_seen and worker.stop is None:
            worker.switch(quorum.epoch + 1)
        return True

    def stop_reason(self) -> int:
        """The strongest stop reason any member saw (``STOP_REASONS``), from the step's sum; ``NONE`` when none did."""
        return max((r for r, seen in zip(STOP_REASONS, self.stops_seen) if seen), default=NONE)

    def stop_or_save(self) -> None:
        """The quorum's agreed stop at this boundary (a reason any rank saw, or ``train.exit_at_step``), with
        its save; else the durable tier's save by policy."""
        worker = self.worker
        reason = self.stop_reason()
        planned = worker.rules.exit_at_step is not None and worker.step_index >= worker.rules.exit_at_step
        if worker.step_index < worker.steps and (reason != NONE or planned):  # the last step ends the run anyway
            worker.stop_here(reason)
        elif worker.checkpoints is not None:
            began = time.perf_counter()
            saved = worker.checkpoints.save(self.quorum, worker.step_index, worker.health(),
                                            last_step=worker.step_index == worker.steps, stopping=False,
                                            check=worker.replica_check())
            if saved and worker.lifecycle is not None:  # the time limit keeps room for one step and one save
                worker.lifecycle.note_save(time.perf_counter() - began)
            if saved and worker.fingerprints is not None:  # the digests of the checkpoints deleted since go
                worker.fingerprints.keep_saved(worker.checkpoints.restorable())


class LiveWorker:
    def __init__(self, store: dist.Store, args: LiveArgs, rank: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, loss_of: MicroBatchLoss | None, sample_range: SampleRange | None,
                 scheduler: Any = None, *, seed: int, checkpoint: CheckpointConfig | None = None,
                 lifecycle: Lifecycle | None = None, rules: LiveRules = DEFAULT_RULES,
                 static_files: Callable[[Path], None] | None = None, stateful: Mapping[str, Stateful] | None = None,
                 embedding: torch.nn.Parameter | None = None):
        self.seed = seed  # the run's: each micro-batch's random draws derive from it (rng.py)
        self.rules = rules
        self.store, self.rank, self.world, self.steps = store, rank, args.world, args.steps
        self.run_dir, self.micro_batches = args.run_dir, args.micro_batches
        # the step's loss and sample ranges: ``LiveRank.step`` hands in the ones of each call before it steps
        self.loss_of, self.sample_range = loss_of, sample_range
        self.micro_batch_s, self.checkpoint_every = args.micro_batch_s, args.checkpoint_every
        self.collective_timeout = timedelta(seconds=args.collective_timeout_s)
        self.events = EventLog(events_path(args.run_dir), rank=rank)
        self.model, self.optimizer = model, optimizer
        # the place among the parameters of the one whose gradient norm decides checkpoint health (and the
        # monitor's figure): taken from the step's summed gradient, so every member finds the same
        self.embedding_index = (next(i for i, p in enumerate(model.parameters()) if p is embedding)
                                if embedding is not None and (rules.health.enabled or rules.monitor) else None)
        self.group_size, self.shard = args.group_size, shard_of(rank, args.group_size)
        # the step's fixed tree of micro-batches over the replica groups' slots (group_reduce)
        self.slots = SlotLayout(args.world // args.group_size, args.group_size // args.tp, args.micro_batches, args.tp)
        # whole replicas, our own row shards or FSDP2 (tensor parallel inside it): chosen once (live/layout.py)
        self.layout = build_layout(model, optimizer, self, rank, args.group_size, self.slots)
        self.log = logging.getLogger(LOGGER_NAME)
        # the drill's gradient faults, at their step each time it is computed (a redone step is hit again)
        self.faults = FaultInjector(list(rules.gradient_faults), args.run_dir, rank, args.world, self.events.emit,
                                    once_per_run=False)
        # its module faults, once in the run (a transient miscompute: the rerun of that step is clean);
        # installed before the detection points, so that a point sees a fault at its module
        self.site_faults = FaultInjector(list(rules.site_faults), args.run_dir, rank, args.world, self.events.emit)
        self.site_faults.install(model)
        self.sdc = (LiveSdc(rules.sdc, model, args.micro_batches, rank, args.run_dir, self.log, self.events,
                            self.reports, shards=args.group_size, over_shards=self.layout.over_shards, tp=args.tp,
                            tp_rank=self.shard % args.tp)
                    if rules.sdc.enabled else None)
        # rollback mode: the data positions it skips, and the spike test's plugin, which restores through this
        # worker's ``roll_back`` (the quorum's durable tier)
        self.positions = DataPositions() if rules.rollback is not None else None
        rollback = None if rules.rollback is None else SpikeRollback(
            RollbackGuard(rules.rollback, rules.skip), self.positions, self, self.events, samples_of=lambda check: 1,
            reports=self.reports)
        self.judge = LiveJudge(StepSkips(rules.skip, rules.max_consecutive_skips, self.log, self.events.emit,
                                         reports=self.reports, tokens_per_step=rules.tokens_per_step),
                               self.sdc, rollback, self.positions)
        # what an undo restores, a joiner receives and a checkpoint holds (the scheduler, the loop's objects)
        self.state = LiveState(model, optimizer, self.judge, scheduler, stateful)
        self.fingerprints = (LiveFingerprints(rules.fingerprint, model, optimizer, self.state, rank, args.group_size,
                                              self.log, self.events, self.reports, self.sdc)
                             if rules.fingerprint.enabled else None)
        self.quorum: Quorum | None = None
        self.group: dist.ProcessGroup | None = None
        self.step_index = 0
        self.previous: tuple[int, dict] | None = None  # (step, ``LiveState.undo_point`` before that step's update)
        self.last_beat = -BEAT_S
        # the drill's transient fault: this rank's all-reduce of that step counts as failed once
        self.fail_after_reduce = args.fail_after_reduce
        self.probe = PeerProbe(store, rank)  # the lighthouse's stall watch: marks, and probes of the peers
        self.reduce_marks = ReduceMarks(store, rank, self.events, args.stall_collective,
                                        self.probe if args.stall_cut else None)
        self.resume_from = args.resume
        # the durable tier (``checkpoint``: the ``checkpoint`` section; None: the drill's workload, none)
        self.checkpoints = None if checkpoint is None else LiveCheckpoints(
            store, args.run_dir, checkpoint, rank, model, optimizer, self.group_size, self.layout.whole_state, self.state,
            self.events, self.collective_timeout, self.beat, static_files, world=args.world,
            ranks_per_node=rules.ranks_per_node or args.world, after_commit=self.site_faults.after_commit,
            marks=self.reduce_marks, wipes=self.site_faults, max_load_failures=rules.max_step_failures)
        self.lifecycle = lifecycle  # this rank's stop reasons (its signals, the kill switch, the time limit)
        self.stop: LiveStop | None = None  # the quorum agreed to stop, and saved: no more steps
        self.receiving = False  # a joiner's state transfer in progress (``join``)
        self.step_failures = StepFailures(rules.max_step_failures)  # the current step's failed attempts in a row
        # a durable restore raised since the state was last whole (``restore``): it may be partly the
        # checkpoint's, so a stop saves nothing then (the newest checkpoint stays the resume point)
        self.state_in_doubt = False
        self.agreed_stop = NONE  # the stop the members of a new epoch agreed on after a failed one (``recover``)

    @property
    def committed(self) -> CommittedStep | None:
        """The step this rank committed last (after a join: the lowest live rank's)."""
        return None if self.state.committed is None else CommittedStep(**self.state.committed)

    def begin(self, rejoin: bool) -> None:
        """Takes this rank's place: joins (a replacement, a rank left out), or enters the job's first epoch,
        resumed from the launcher's checkpoint if it chose one; ``step_index`` is then the step it starts at."""
        self.events.emit("live_start", pid=os.getpid(), rejoin=rejoin, node=node_name())
        if rejoin:
            self.join()
        else:
            quorum = read_quorum(self.store, latest_epoch(self.store))
            if quorum.resume_from is not None:
                self.state.load(safe_torch_load(checkpoint_path(self.run_dir, quorum.resume_from, self.shard)))
            try:
                self.enter(quorum, quorum.start_step)
            except RuntimeError as error:  # a member died before the job's first group was built (a node
                self.recover(error)  # that could not start its rank): the epoch after it, or a join
            if self.resume_from is not None and self.checkpoints is None:
                raise RuntimeError(f"live recovery: --resume {self.resume_from} needs the durable tier "
                                   "(the checkpoint section), which this rank was not given")
            # a job's start: its newest checkpoint, if any, loaded by the first epoch's members together (a
            # rank that joined instead has a peer's state)
            if self.checkpoints is not None and self.rank not in self.quorum.joining:
                resumed = self.checkpoints.resume(self.quorum, self.resume_from)
                if resumed is not None:
                    self.step_index = resumed
                    self.store.set(progress_key(self.rank), str(self.step_index))
            if self.rules.exit_at_step is not None and self.step_index >= self.rules.exit_at_step:
                self.stop_here(NONE)  # resumed at (or past) the planned stop: saved, nothing trained

    def train(self) -> Iterator[int]:
        """After ``begin``: trains to the last step, yielding the index of each step as it commits it (a step
        undone after a peer's failure is yielded again when it is redone; a rank that rejoins yields the
        last step before the boundary it rejoined at); at the end writes the final state."""
        while self.stop is None:
            step = self.step_index
            try:
                if step >= self.steps:
                    joining = self.wait_for_join_epoch()  # the replacement joins at the last boundary
                    if joining is None:
                        break
                    self.switch(joining)
                    continue
                if self.agreed_stop != NONE:  # asked for while epochs kept failing: at the committed step
                    self.stop_here(self.agreed_stop, save=not self.state_in_doubt)
                    continue
                if not self.step():
                    continue  # the step's computation raised somewhere: tried again (step_failures.py)
                if self.step_index <= step:  # rolled back: the loop goes on from the restored step
                    yield self.step_index - 1
                    continue
            except RuntimeError as error:  # gloo's errors (a peer died, a timeout) and EpochAborted
                self.recover(error)
                if self.step_index > step:
                    # past this step: it committed before its save or join failed, or this rank rejoined at a
                    # later boundary; the loop still sees it (the last one: the lowest live rank's report)
                    yield self.step_index - 1
                continue
            yield step
        if self.stop is not None:
            self.events.emit("live_stopped", step=self.step_index, epoch=self.quorum.epoch, reason=self.stop.reason,
                             exit_code=self.stop.exit_code)
            return
        atomic_write_bytes(final_path(self.run_dir, self.rank),
                           serialised(self.state.state_dict()))
        self.events.emit("live_done", step=self.step_index, epoch=self.quorum.epoch)
        self.store.set(done_key(self.rank), "1")

    def enter(self, quorum: Quorum, start_step: int) -> None:
        """Makes this epoch's process group (a fresh store prefix: no state of the old one is reused)."""
        self.quorum, self.step_index = quorum, start_step
        self.group = collective.make_group(self.store, quorum.epoch, quorum.index(self.rank), len(quorum.members),
                                           self.collective_timeout, self.beat)
        self.store.set(entered_key(self.rank), str(quorum.epoch))

    def wait(self, work: dist.Work) -> None:
        collective.wait(work, self.store, self.quorum.epoch, self.beat)

    def wait_all(self, works: list[dist.Work]) -> None:
        collective.wait_all(works, self.store, self.quorum.epoch, self.beat)

    def beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat >= BEAT_S:
            self.store.add(beat_key(self.rank), 1)
            self.last_beat = now

    def reports(self) -> bool:
        """This rank writes the run's events of a decision (the closure mode's rank 0): the quorum's first."""
        return self.quorum is not None and self.quorum.index(self.rank) == 0

    def compute(self, step: int, exchange: Exchange, mine: list[int], catch: bool = False
                ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None, str | None]:
        """This rank's parts of ``step``'s sum, computed by its layout (``mine``: its micro-batches), with SDC
        detection on their extras (each micro-batch's detection points' values, ``live/sdc.py``), and with
        ``catch`` the line of an error of the loss or its backward (``live/step_failures.py``)."""
        self.site_faults.at_step_start(step + 1)  # the closure mode's step number
        extras = self.begin_extras()
        work = StepWork(step, self.loss_of, self.data_position(step), self.micro_batches, self.seed, self.beat,
                        None if extras is None else functools.partial(self.measure, extras), self.micro_batch_s,
                        functools.partial(self.leave_if_epoch_ended, step))
        computed, failure = self.layout.compute(work, exchange, mine, catch)
        return computed, extras, failure

    def leave_if_epoch_ended(self, step: int) -> None:
        """Between a step's micro-batches (whole replicas and rows: FSDP2's own collectives watch the epoch):
        ``EpochAborted`` once the epoch has ended, as a wait in a collective would raise it at the step's sum."""
        collective.leave_if_ended(self.store, self.quorum.epoch, f"computed step {step}")

    def begin_extras(self) -> torch.Tensor | None:
        """With SDC detection on, the step's extras: ``[micro_batches, width]`` zeros, a row filled by
        ``measure`` for each micro-batch this rank computes, the detection points reset; None without."""
        if self.sdc is None:
            return None
        self.sdc.begin_step()
        return torch.zeros(self.micro_batches, self.sdc.width)

    def measure(self, extras: torch.Tensor, micro_batch: int) -> None:
        """The detection points' values of the micro-batch just computed, into its row of ``extras``."""
        extras[micro_batch] = self.sdc.micro_batch_values()

    def reduce(self, exchange: Exchange, computed: dict[int, torch.Tensor], flags: list[int],
               extras: torch.Tensor | None) -> StepSum:
        """The step's sum of every member's ``computed`` by the layout (``ordered_sum`` for whole replicas,
        ``group_reduce`` for sharded groups: by micro-batch, or FSDP2's shares by group), ``flags`` and
        ``extras`` summed beside; sets this rank's gradients from it."""
        return self.layout.reduce(exchange, computed, flags, extras)

    def step(self) -> bool:
        """Trains the next step (``LiveStep``): whether it committed (not when a rank's computation of it raised)."""
        return run_step(LiveStep(self))

    def check_replicas(self, quorum: Quorum, step: int) -> bool:
        """The replica check before ``step`` (from 0; ``guards.fingerprint``), every member alike, as the closure
        mode's state check: an attributed replica repaired and struck (a rank at its strike limit leaves here,
        before it computes), and what no replica can repair recomputed from the newest healthy durable
        checkpoint whose restored state every member finds as that save held it, restored by the quorum
        (``LiveCheckpoints.roll_back``, ``LiveFingerprints.restored_agrees``; the data positions are not moved:
        the steps since are computed again from the same data). Whether the run went back to that checkpoint
        (``fingerprints.restored``)."""
        fingerprints = self.fingerprints
        fingerprints.check(self.group, quorum, step + 1, self.wait)  # repairs a replica before it computes
        self.leave_if_struck_out(fingerprints.take_struck_out())
        if not fingerprints.recompute:
            return False
        # the step's check, tried again after a failed restore, restores again (``LiveFingerprints.restoring``)
        restored = None if self.checkpoints is None else self.restore(
            step, "the restore for a recompute", lambda: restore_agreeing(
                step + 1, lambda before: self.checkpoints.roll_back(quorum, before),
                lambda at: fingerprints.restored_agrees(self.group, quorum, at, self.wait), self.log))
        fingerprints.recomputing_from(step + 1, restored)
        return restored is not None

    def leave_if_struck_out(self, faulty: tuple[int, ...]) -> None:
        """At a step boundary, every member alike: ``faulty``, the ranks at their strike limit (``guards.sdc``:
        SDC's rerun, a replica fingerprint). A planned exit: the durable save in flight commits first, then
        a struck-out rank leaves (exit 17) and the others go on without its group."""
        if not faulty:
            return
        self.settle_saves()
        self.sdc.leave_if_struck_out(faulty)

    def data_position(self, step: int) -> int:
        """The ``step`` handed to ``loss_of`` (and seeding its random draws) for ``step``: past rollback mode's
        skipped windows (``live/data_positions.py``), the step itself without them."""
        return step if self.positions is None else self.positions.position(step)

    def roll_back(self, before_step: int) -> int | None:
        """Rollback mode's restore (``checkpoint.rollback.RestoresBefore``), on every member at the same step:
        the newest healthy durable checkpoint before ``before_step`` (1-based), loaded by the quorum; its step,
        None when there is none (or no durable tier)."""
        if self.checkpoints is None:
            return None
        # the spiked step, undone with the failed epoch (``LiveStep.update``), spikes and restores again
        restored = self.restore(before_step - 1, "the restore for a rollback",
                                lambda: self.checkpoints.roll_back(self.quorum, before_step))
        if restored is not None:
            self.positions.move_to(restored)
        return restored

    def restore(self, step: int, what: str, restore: Callable[[], T]) -> T:
        """A durable restore by the quorum before ``step`` (from 0), every member alike (``restore()``: rollback
        mode's, a recompute's; ``what`` it is, for the lines). A load that failed (``RestoreFailed``, on every
        member alike: this rank's state may be partly the checkpoint's) ends the epoch as a failed collective,
        as a member's death in the restore does, and the step restores again; with no checkpoint left that
        loads (``NothingToRestore``, ``live/load_failures.py``) every member ends with exit 19, as after a step
        that failed as often."""
        try:
            return restore()
        except RestoreFailed as error:
            self.state_in_doubt = True
            raise RuntimeError(f"live recovery: {what} before step {step + 1} failed: "
                               f"{str(error).splitlines()[0][:300]}") from error
        except NothingToRestore as nothing:
            self.end_failed(step, nothing)

    def rolled_back(self, restored: int, loss: float, norm: float) -> None:
        """After a rollback to ``restored`` committed steps: the run goes on from there, no undo left (the
        restored state is every member's), the loop told through ``committed``."""
        self.previous = None
        self.state_in_doubt = False
        self.state.committed = dataclasses.asdict(CommittedStep(restored - 1, loss, norm, skipped=False,
                                                                rolled_back=True))
        self.step_failures.committed()
        self.step_index = restored
        if self.fingerprints is not None:  # the check before the next step compares with the restored state
            self.fingerprints.remember(self.step_index + 1)
        self.store.set(progress_key(self.rank), str(self.step_index))

    def aborted(self, step: int, cause: DataSkipAbort) -> None:
        """Every member, at the same step: the guards' abort (exit 3), raised; the quorum's first member records
        it for the launcher's line first (``LiveResult.stop``: a rollback abort's reason, ``cli.train_live``)."""
        if self.reports():
            reason = "rollback" if isinstance(cause, RollbackAbort) else "data_skip"
            stop = LiveStop(step, reason, str(cause), cause.exit_code)
            self.store.set(STOPPED, json.dumps(dataclasses.asdict(stop)))
        raise cause

    def step_failed(self, step: int, ranks: int) -> None:
        """Every member, at the same step: ``ranks`` ranks' computation of ``step`` raised. Tried again, or
        after ``max_step_failures`` attempts in a row ``StepFailed`` on every member, the reporter's line
        naming the step and an error (``live/step_failures.py``)."""
        verdict = self.step_failures.failed(step)
        attempts = self.step_failures.count
        error = self.store.get(STEP_FAILURE).decode() if has(self.store, STEP_FAILURE) else "unknown error"
        if self.reports():
            self.events.emit("live_step_failed", step=step, epoch=self.quorum.epoch, ranks=ranks, attempt=attempts,
                             error=error, verdict=verdict.value)
        if verdict is StepFailureVerdict.RETRY:
            self.log.warning("step %d failed on %d rank(s) (%s): attempt %d of %d, trying it again", step, ranks,
                             error, attempts, self.step_failures.limit)
            return
        self.end_failed(step, StepFailed(f"step {step} failed {attempts} times in a row "
                                         f"(fault_tolerance.max_step_failures), {error}; the run ends with nothing "
                                         "saved at this step"))

    def end_failed(self, step: int, failed: StepFailed) -> NoReturn:
        """Every member, at the same step: ``failed`` raised (exit 19), the reporter's record of it first."""
        if self.reports():  # the launcher's record of how the run ended (``LiveResult.stop``)
            stop = LiveStop(step, "restore_failed" if isinstance(failed, NothingToRestore) else "step_failed",
                            str(failed), failed.exit_code)
            self.store.set(STOPPED, json.dumps(dataclasses.asdict(stop)))
        raise raised_by_every_rank(failed)

    def rerun(self, step: int, exchange: Exchange, mine: list[int], flags: list[int]) -> StepSum:
        """SDC detection's rerun of ``step`` (``live/sdc.py``): the same micro-batches, the same sum, with
        ``flags`` summed beside; its gradients set, with the drill's gradient faults as at the first pass.
        An error of the computation raises: it ends this rank (with FSDP2, ``ShareAbandoned``)."""
        computed, extras, _ = self.compute(step, exchange, mine)
        summed = self.reduce(exchange, computed, flags, extras)
        self.faults.after_backward(step + 1, self.model)
        return summed

    def norms(self, grads: list[torch.Tensor]) -> tuple[float, float | None]:
        """The step's global norm by rows (``sharded_params.norm_by_rows``), every member's alike and bitwise
        the same for any layout: of the whole gradient, or from the rows' squares gathered in the group; and
        the embedding's from its rows' squares (None when it is not monitored), with no collective of its own."""
        squares = self.layout.row_squares(grads)
        embedding = None if self.embedding_index is None else math.sqrt(float(squares[self.embedding_index].sum()))
        return norm_by_rows(squares), embedding

    def health(self) -> dict | None:
        """The health a durable save of the committed steps records (``guards.health``): the verdict on the
        embedding norm of the last committed step; None when not monitored or no step was trained since the
        job started or resumed."""
        committed = self.committed
        return save_health(self.rules.health, committed.embedding_norm if committed is not None else None)

    def replica_check(self) -> Callable[[dict | None], dict | None] | None:
        """The check before a durable save of the committed steps (``guards.fingerprint`` on): the replicas
        compared, an attributed one repaired, the save's health merged as the closure mode's
        (``LiveFingerprints.before_save``); None when fingerprints are off."""
        if self.fingerprints is None:
            return None
        fingerprints, quorum, step = self.fingerprints, self.quorum, self.step_index
        return lambda health: fingerprints.before_save(self.group, quorum, step, self.wait, health)

    def settle_saves(self) -> None:
        """Before an abort ends every member at the same step: the durable save in flight committed."""
        if self.checkpoints is not None and self.quorum is not None:
            self.checkpoints.settle(self.quorum)

    def stop_reason(self) -> int:
        """This rank's strongest stop reason now: its lifecycle's (the kill switch, its signals, the time limit)
        or the launcher's signal (``STOP``); ``NONE`` without one."""
        reason = self.lifecycle.local_reason() if self.lifecycle is not None else NONE
        return max(reason, SIGNAL) if has(self.store, STOP) else reason

    def agree_on_stop(self) -> int:
        """In a new epoch entered after a failed one (every member comes through ``recover``): the strongest
        stop reason of any member, in one all-reduce. Steps or restores that keep failing reach no step
        boundary where the step's sum would carry it."""
        reasons = torch.tensor([self.stop_reason()])
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.wait(self.group.allreduce([reasons], options))
        return int(reasons.item())

    def stop_here(self, reason: int, save: bool = True) -> None:
        """The quorum's stop at this boundary (every member calls it at the same one): a lifecycle
        ``reason``, or ``NONE`` for ``train.exit_at_step``. Saves the committed steps first (the drill's
        workload has no durable tier, and a state in doubt is not saved: it stops with nothing saved), then
        says so as the closure mode does."""
        step = self.step_index
        if self.checkpoints is not None and save:
            began = time.perf_counter()
            self.checkpoints.save(self.quorum, step, self.health(), last_step=False, stopping=True,
                                  check=self.replica_check())
            if self.lifecycle is not None:
                self.lifecycle.note_save(time.perf_counter() - began)
        last_checkpoint = self.checkpoints.last_saved if self.checkpoints is not None else None
        if reason == NONE:
            self.stop = LiveStop(step, RunOutcome.EXIT_AT_STEP.value, f"train.exit_at_step {self.rules.exit_at_step}",
                                 EXIT_OK)
            self.log.info("run %s at step %d", self.stop.reason, step)
            if self.reports():
                self.events.emit("run_finished", step=step, reason=self.stop.reason, last_checkpoint=last_checkpoint)
                self.store.set(STOPPED, json.dumps(dataclasses.asdict(self.stop)))
            return
        message = self.lifecycle.describe(reason) if self.lifecycle is not None else "received a stop signal"
        self.stop = LiveStop(step, REASON_NAMES[reason], message, EXIT_CODES[reason])
        self.log.warning("stopping at step %s: %s; exit %d (checkpoint: step %s)", step, self.stop.message,
                         self.stop.exit_code, last_checkpoint)
        if self.reports():
            self.events.emit("lifecycle_stop", step=step, reason=self.stop.reason, message=self.stop.message,
                             exit_code=self.stop.exit_code, last_checkpoint=last_checkpoint,
                             outcome=stop_outcome(reason, trained=True).value)
            self.store.set(STOPPED, json.dumps(dataclasses.asdict(self.stop)))

    def await_peers_committed(self, step: int) -> None:
        """The transient drill fails this rank's all-reduce *after the others' succeeded*: a peer whose
        own all-reduce has not returned yet when this rank gives up would fail it too, and commit nothing."""
        deadline = time.monotonic() + WAIT_S
        for peer in (m for m in self.quorum.members if m != self.rank):
            while int(wait_for(self.store, progress_key(peer), WAIT_S, self.beat)) <= step:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"live recovery drill: rank {peer} did not commit step {step} in {WAIT_S:.0f} s")
                self.beat()
                time.sleep(0.005)

    def leave_epoch(self, error: RuntimeError, committed: int) -> Quorum:
        """Ends the current epoch on this rank after its collective failed: reports ``committed`` (the
        last step it committed, or ``NO_STATE`` for a joiner whose transfer did not finish) and returns
        the lighthouse's next epoch."""
        epoch, fence = self.quorum.epoch, self.fence()
        if fence is not None and fence >= epoch:
            # declared dead in this epoch (silent behind a cut link, now back): another process holds
            # this rank; reporting or asking to join would put two of it in a quorum
            self.events.emit("live_fenced", step=self.step_index, epoch=epoch, fence_epoch=fence, pid=os.getpid())
            raise Fenced(f"rank {self.rank} (pid {os.getpid()}) was fenced in epoch {fence}")
        collective.end_epoch(self.store, epoch)  # the members still blocked learn it now
        if self.group is not None:  # None: the epoch ended while its group was being built
            collective.retire(self.group, self.collective_timeout)  # destroyed once nothing pending is left
        self.group = None
        self.probe.report_if_asked(epoch, self.quorum.members)
        self.store.set(report_key(epoch, self.rank), str(committed))
        self.events.emit("live_collective_failed", step=None if committed == NO_STATE else committed, epoch=epoch,
                         error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        return Quorum.from_json(wait_for(self.store, epoch_key(epoch + 1), WAIT_S, self.layout.waiting_beat(epoch)))

    def recover(self, error: RuntimeError) -> None:
        """Leaves the failed epoch and enters the next one, or joins again if left out; a failure while the
        next epoch's group is being built (a member died then: ``EpochAborted``) ends that epoch too, and
        the rank goes on to the one after."""
        failed_at = time.time()
        while True:
            epoch, committed = self.quorum.epoch, self.step_index
            quorum = self.leave_epoch(error, committed)
            if self.rank not in quorum.members:
                self.layout.left_out(quorum)
                self.join()
                return
            if quorum.start_step < committed:
                step, state = self.previous or (None, None)
                if step != quorum.start_step:
                    raise RuntimeError(f"live recovery: epoch {quorum.epoch} starts at step {quorum.start_step}, "
                                       f"rank {self.rank} can undo only step {step}")
                self.state.undo(state)
                self.state_in_doubt = False
                self.events.emit("live_undo", step=step, epoch=epoch)
            try:
                self.enter(quorum, quorum.start_step)
                self.agreed_stop = self.agree_on_stop()
            except RuntimeError as again:
                error = again
                continue
            break
        self.events.emit("live_resumed", step=quorum.start_step, epoch=quorum.epoch,
                         stalled_s=time.time() - failed_at)

    def wait_for_join_epoch(self) -> int | None:
        """The next epoch, a join; None once every rank awaited at the end is a member (``awaited_at_end``)."""
        deadline = time.monotonic() + WAIT_S
        while latest_epoch(self.store) <= self.quorum.epoch:
            if set(self.quorum.members) >= awaited_at_end(self.store, self.world, self.group_size):
                return None
            self.beat()
            if time.monotonic() > deadline:
                raise TimeoutError(f"live recovery: rank {self.rank} waited {WAIT_S:.0f} s for a replacement")
            time.sleep(0.005)
        return self.quorum.epoch + 1

    def switch(self, epoch: int) -> None:
        """A survivor's side of a join: at this step boundary, the joiners receive the state."""
        quorum = read_quorum(self.store, epoch)
        if quorum.source == self.rank:
            self.store.set(start_key(epoch), str(self.step_index))
        began = time.time()
        self.enter(quorum, self.step_index)
        sent = send_shards(self.group, quorum, self.rank, self.group_size, self.state, self.wait)
        self.judge.welcome(quorum.joining)
        self.events.emit("live_switch", step=self.step_index, epoch=epoch, state_bytes=sent,
                         paused_s=time.time() - began)

    def join(self) -> None:
        """A joiner's side: ask, wait for an epoch that names this rank, receive the state at its start.
        A failure during the transfer (a peer died: a second failure during the join) ends that epoch
        with no state to report (``NO_STATE``); the group is out again, and this rank asks again."""
        asked = time.time()
        self.receiving = True  # this rank's state is a replica's only once the transfer is done
        while True:
            # only an epoch published after this request answers it: an older join epoch naming this rank
            # let in a process of it that died (this one replaces it; entering that epoch would fence it)
            asked_in, fence = latest_epoch(self.store), self.fence()
            self.store.add(ready_key(self.rank), 1)
            self.events.emit("live_join_wait", step=None)
            quorum = self.wait_to_be_let_in(asked_in, fence)
            try:
                # in its group before the survivors reach their step boundary: their pause is not spent
                # waiting for this rank to connect; the step they start from is set before any of them enters
                self.enter(quorum, self.step_index)
                received = send_shards(self.group, quorum, self.rank, self.group_size, self.state, self.wait)
            except RuntimeError as error:
                self.layout.left_out(self.leave_epoch(error, NO_STATE))
                continue
            break
        self.step_index = start = int(self.store.get(start_key(quorum.epoch)))
        self.receiving = False
        self.judge.welcome(quorum.joining)
        self.previous = None
        self.events.emit("live_joined", step=start, epoch=quorum.epoch, state_bytes=received,
                         waited_s=time.time() - asked)

    def save_own(self) -> LiveLocalTier | None:
        """The store is gone (the launcher died): this rank's state of its committed steps to its per-rank tier
        for the restart to resume from (``LiveCheckpoints.save_own``), when it is one step's state: not being
        received from a replica, no parameter gathered whole (a step's computation that stopped at the loss
        changed no state: the update is applied after the step's last store read). The tier, None when nothing
        was saved."""
        if self.checkpoints is None or self.committed is None or self.receiving or not self.layout.at_rest():
            return None
        return self.checkpoints.save_own(self.step_index)

    def fence(self) -> int | None:
        """The epoch of this rank's newest death the lighthouse recorded (``fence_key``), if any."""
        return int(self.store.get(fence_key(self.rank))) if has(self.store, fence_key(self.rank)) else None

    def wait_to_be_let_in(self, asked_in: int, fence: int | None) -> Quorum:
        """The join epoch that answers a request made in epoch ``asked_in``, when the rank's fence was
        ``fence``. A fence raised meanwhile means this process was declared dead while it waited out of
        the quorum (silent behind a cut link, now back) and replaced: the epoch is its replacement's."""
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.fence() != fence:
                self.events.emit("live_fenced", step=self.step_index, epoch=asked_in, fence_epoch=self.fence(),
                                 pid=os.getpid())
                raise Fenced(f"rank {self.rank} (pid {os.getpid()}) was fenced in epoch {self.fence()} while it "
                             "waited to join")
            quorum = read_quorum(self.store, latest_epoch(self.store))
            if quorum.epoch > asked_in and self.rank in quorum.joining:
                return quorum
            self.beat()
            if time.monotonic() > deadline:
                raise TimeoutError(f"live recovery: rank {self.rank} was not let in within {WAIT_S:.0f} s")
            time.sleep(0.005)
