"""The checkpoint tiers in live mode: ``CheckpointManager``'s DCP checkpoints (``global_step_N/``, committed
with a manifest, mirrored by ``backup.attach``), saved by every rank of the current quorum at a step
boundary they all reached, each rank's local and memory tiers (``live.local_tier``), and the resume of
a whole job from the newest verified one (``checkpoint.resume``, ``auto`` by default).

A rank of a replica group of several ranks holds its rows of every parameter and their optimizer
state (``sharded_params``), bitwise the same in every replica group. For a save or a resume the group
makes them whole first (``ShardedParams.whole``: one exchange inside the group, on the epoch's group,
before the save's thread starts), so every rank saves the same whole tensors and DCP writes each once
(it deduplicates replicated entries across ranks): a checkpoint holds the whole parameters and
optimizer state, keyed by parameter name, and any later quorum, of any number of replica groups and
ranks per group, loads it; each rank then keeps its own rows. While a save runs each rank holds the
whole state, not its shard: a save by DCP of the shards themselves (DTensors) is not built.

DCP's collectives need a registered process group, which the epoch's step group
(``collective.make_group``) is not; so an epoch that saves or resumes makes this process's default
group from its quorum (store prefix ``ckpt/<epoch>``, on a store connection of its own), and a
``CheckpointManager`` bound to it, both kept until the quorum changes. The group is made once every
member has arrived at the store (``collective.arrive``): a member stopped or dead before that is waited
for without a thread, so nothing is left blocked in a rendezvous when the epoch ends.

With ``checkpoint.async_save`` (the default) the loop blocks for the staging only (the group's exchange
and the copy of the whole state into the staging buffers, before the rank holds its rows again); the
files, DCP's gather and rank 0's commit run in the manager's background thread on the checkpoint's
group while the next steps run. That save is waited for (committed on every member: a barrier) before
the next one, and before the job's last save and a stop's save returns, so a process never exits with
its save in flight. A save still in flight when its quorum ends is settled when the next checkpoint
group is made: if that epoch ended by a failure (its abort key is set: a member died or gave up) the
save is abandoned on every member alike (a member that died before handing its files' checksums to
rank 0 leaves it a ``.tmp-`` directory, never a checkpoint; one that had handed them leaves it complete
and committed, as the commit protocol makes it), else (a group joined) it is waited for. The policy
then counts the abandoned step as not saved. The stop's and the last step's saves are synchronous.

The save runs between the stall watch's marks (``live/stall.py``): a member stopped or hung inside it
takes its group out at the stall bound, as in a step's all-reduce, not at the heartbeat timeout.

Every wait runs ``collective.watched``: the rank beats meanwhile (a long save is not a hang) and watches
the epoch's abort key, because DCP's collectives do not: a member waiting in one on a peer that died,
or that gave up, would wait for gloo's timeout. A save that fails or is aborted ends the epoch like any
failed collective (the group is dropped, the save's thread abandoned); the step stays committed and
the next save boundary saves again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.backup.attach import attach_mirror
from trainguard.backup.background import BackgroundMirror
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import CheckpointInfo, list_checkpoints
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import read_manifest
from trainguard.checkpoint.memory_tier import DEFAULT_MEMORY_DIR, run_key
from trainguard.checkpoint.save_policy import SaveDecision, decide_save
from trainguard.checkpoint.local.paths import node_of
from trainguard.errors import RestoreFailed
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.live.collective import EpochAborted, abort_key, arrive, watched
from trainguard.live.load_failures import LoadFailures, NothingToRestore
from trainguard.live.local_tier import LiveLocalTier, ResumePoint, choose_live_resume
from trainguard.live.quorum import Quorum
from trainguard.live.replica_mesh import keep_mesh_groups
from trainguard.live.stall import ReduceMarks
from trainguard.live.state import LiveState

T = TypeVar("T")
log = logging.getLogger("trainguard")
REPLICA_DIMS = ["dp_replicate", "dp_shard"]  # the manifest's mesh: replica groups of the quorum x their ranks


class SaveFailed(RuntimeError):
    """A durable save of the quorum failed: handled as a failed collective (the epoch ends)."""


class LiveCheckpoints:
    """One rank's checkpoint tiers in a live run: ``resume`` at the start of a job, ``save`` after each
    committed step (the policy of ``CheckpointManager.save``: the durable tier every ``save_interval``
    steps, the last step, and before a stop; the local and memory tiers, ``live.local_tier``, every
    ``local_interval`` and ``memory_interval`` steps)."""

    def __init__(self, store: dist.TCPStore, run_dir: Path, config: CheckpointConfig, rank: int,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, group_size: int,
                 whole: Callable[[], AbstractContextManager[None]], state: LiveState, events: EventLog,
                 timeout: timedelta, beat: Callable[[], None], static_files: Callable[[Path], None] | None = None,
                 *, world: int, ranks_per_node: int, after_commit: Callable[[int, Path], None] | None = None,
                 marks: ReduceMarks | None = None, wipes: FaultInjector | None = None, max_load_failures: int):
        self.config = config
        # the run's failed loads of each checkpoint a restore chose, in the store; one that failed
        # max_load_failures times (fault_tolerance.max_step_failures) is passed over (``live/load_failures.py``)
        self.load_failures = LoadFailures(store, rank, world, max_load_failures)
        self.passed_over: set[int] = set()  # the checkpoints this process's choices passed over, said once
        # the stall watch's marks (``live/stall.py``): a member stopped or hung inside a durable save takes its
        # group out at the stall bound, as inside a step's all-reduce, not at the heartbeat's ``hang_s``
        self.marks = marks
        self.after_commit = after_commit  # the drill's checkpoint file faults (the quorum's first member's commit)
        self.wipes = wipes  # the drill's ``wipe`` of a node's local directory, after a local save (``_wipe``)
        per_rank = dict(rank=rank, world=world, group_size=group_size, ranks_per_node=ranks_per_node, events=events)
        self.memory = LiveLocalTier(
            run_dir, tier="memory", template=(config.memory_dir or DEFAULT_MEMORY_DIR).replace("{run}", run_key(run_dir)),
            interval=config.memory_interval, keep_last=config.memory_keep_last, **per_rank) \
            if config.memory_interval else None
        self.local = LiveLocalTier(run_dir, tier="local", template=config.local_dir, interval=config.local_interval,
                                   keep_last=config.local_keep_last, **per_rank) if config.local_interval else None
        self.store, self.run_dir, self.rank = store, Path(run_dir), rank
        self.model, self.optimizer, self.events = model, optimizer, events
        # whole: the model and optimizer whole inside it (a sharded group's exchange, on the epoch's group)
        self.group_size, self.whole = group_size, whole
        # the guards' state, the scheduler and the loop's objects ride in each checkpoint's extra state, under the
        # closure mode's names for the last two
        self.state = state
        self.timeout, self.beat = timeout, beat
        self.static_files = static_files  # huggingface/ in each checkpoint, as the closure mode writes it
        self.connection: dist.TCPStore | None = None  # the checkpoint groups' store client (see below)
        self.epoch: int | None = None  # the epoch of the default group and the manager
        self.manager: CheckpointManager | None = None
        self.mirror: BackgroundMirror | None = None  # this process's, started when it first commits as the first member
        # the step this rank last saved (its save in flight included) or resumed from: the policy's, kept
        # across epochs (each epoch's manager is new)
        self.last_saved: int | None = None
        self.last_committed: int | None = None  # of those, the newest known committed on every member
        self.in_flight: int | None = None  # the step whose async save is not waited for yet

    def _manager(self, quorum: Quorum, doing: str) -> CheckpointManager:
        """The epoch's checkpoint group and its ``CheckpointManager``, made on the first call of an epoch by
        every member (``doing``: what for, for the error). Every member's arrival is awaited first
        (``collective.arrive``, no thread), so the wait on a member that stopped or died before it arrived
        leaves no thread behind; then the group is made ``watched``. The thread's results are taken here:
        a thread abandoned in a rendezvous (a member lost between its arrival and the group) changes
        nothing of this rank's (seen: one resumed after its rank had joined a later epoch set this rank's
        store connection to its own, blocked one, and the next epoch's group waited on it for gloo's
        timeout, 30 s)."""
        if self.epoch == quorum.epoch:
            return self.manager
        forget_default_group()  # an older epoch's (idle, or abandoned by its save), or none
        try:
            arrive(self.store, f"ckpt/{quorum.epoch}", quorum.index(self.rank), len(quorum.members), quorum.epoch,
                   self.beat, doing)
        except BaseException:
            self._forget_epoch()
            raise
        connection = self.connection
        if connection is None:
            # the group's setup blocks on the store until every member connected: on the rank's own
            # client it would hold up the beats of ``watched`` behind it (one client serialises its calls)
            connection = dist.TCPStore(self.store.host, self.store.port, is_master=False, timeout=self.timeout)
        self.manager = self._watched(quorum, lambda: self._make_manager(quorum, connection), doing)
        self.connection = connection
        # the mirror (checkpoint.mirror.url): the quorum's first member uploads what it commits, with one
        # mirror across its epochs; a member that is first no more lets its queue finish in the background
        attach_mirror(self.manager, self.mirror)
        self.mirror = self.manager.mirror or self.mirror
        self.epoch = quorum.epoch
        return self.manager

    def _make_manager(self, quorum: Quorum, connection: dist.TCPStore) -> CheckpointManager:
        """This process's default group from ``quorum`` (store prefix ``ckpt/<epoch>``) and a manager bound to
        it; reads this rank's objects only, sets nothing (``_manager`` takes the result)."""
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ckpt/{quorum.epoch}", connection),
                                rank=quorum.index(self.rank), world_size=len(quorum.members), timeout=self.timeout)
        groups = len(quorum.members) // self.group_size
        return CheckpointManager(self.run_dir, self.model, self.optimizer, self.state.checkpointed(),
                                 config=self.config, events=self.events, static_files=self.static_files,
                                 mesh_shape=[groups, self.group_size], mesh_dim_names=REPLICA_DIMS,
                                 after_commit=self.after_commit, accept=self._accept)

    def _accept(self, info: CheckpointInfo) -> str | None:
        """The manager's ``accept`` (on the member that chooses a checkpoint to load): why ``info``'s is passed
        over (``LoadFailures``), None when it is not; the first time this process passes one over, its line
        and event."""
        failures = self.load_failures.count(info.step)  # one read of each rank's count
        reason = self.load_failures.rejection(info.step, failures)
        if reason is not None and info.step not in self.passed_over:
            self.passed_over.add(info.step)
            log.error("live recovery: global_step_%d %s; passed over for an older checkpoint from now on", info.step,
                      reason.removeprefix("it "))
            self.events.emit("live_restore_passed_over", step=None, checkpoint=info.step, failures=failures,
                             error=reason)
        return reason

    def _rank_tiers(self) -> dict[str, LiveLocalTier]:
        """The per-rank tiers by name, in order of preference at an equal step (the memory tier saves most often)."""
        return {tier.tier: tier for tier in (self.memory, self.local) if tier is not None}

    def resume(self, quorum: Quorum, checkpoint: Path | None) -> int | None:
        """Every member of a job's first epoch: resumes from ``checkpoint`` (the durable one the launcher
        chose by ``checkpoint.resume`` before starting the ranks, verified again; None: none), or, with
        ``checkpoint.resume: auto``, from the newest step every shard holds in the local or memory tier
        of one of its replicas at least when that is newer (``choose_live_resume``, on the members'
        verified steps gathered on the checkpoint group), the members that lack it receiving it from a
        replica first (``_receive_missing``). Returns the step, None for a fresh start. The per-rank tiers'
        newer steps are dropped: a timeline the job does not continue."""
        mode = self.config.resume
        if checkpoint is not None:  # the managers load the launcher's choice, whatever the mode
            self.config = dataclasses.replace(self.config, resume=str(checkpoint))
        point = ResumePoint("durable", read_manifest(checkpoint).step if checkpoint is not None else None)
        tiers = self._rank_tiers()
        if tiers and mode == "auto":
            self._manager(quorum, "made its checkpoint group to gather its peers' local steps")
            point = choose_live_resume(point.step, self._watched(quorum, lambda: self._held(quorum, tiers),
                                                                 "gathered its peers' local steps"), self.group_size)
        if point.tier != "durable":
            if point.sources:
                self._receive_missing(quorum, tiers[point.tier], point)
            self.state.load(tiers[point.tier].load(point.step))
            path = tiers[point.tier].dir / f"global_step_{point.step}"
            log.info("live run resumes from the %s tier's step %d (%s), newer than the durable checkpoint's (%s)",
                     point.tier, point.step, path, checkpoint)
            if quorum.index(self.rank) == 0:
                self.events.emit("run_started", step=point.step, resumed_from=str(path), tier=point.tier)
        elif checkpoint is not None:
            with self.whole():
                manager = self._manager(quorum, f"made its checkpoint group to resume from {checkpoint}")
                self._watched(quorum, manager.resume, f"resumed from {checkpoint}")
            self.last_saved = self.last_committed = point.step
        for tier in tiers.values():
            tier.discard_newer(point.step or 0)
        return point.step

    def roll_back(self, quorum: Quorum, before_step: int) -> int | None:
        """Rollback mode, every member at the same step: the save in flight settled, the newest healthy durable
        checkpoint before ``before_step`` loaded by the quorum (``CheckpointManager.roll_back``: the newer ones
        deleted), and the per-rank tiers' newer steps dropped. Its step, None when there is none. A load that
        fails raises ``RestoreFailed`` on every member, counted (``live/load_failures.py``); a checkpoint that
        failed too often is passed over, and ``NothingToRestore`` when every one before ``before_step`` was."""
        self._settle(quorum, before_step)
        with self.whole():
            manager = self._manager(quorum, f"made its checkpoint group to roll back before step {before_step}")
            try:
                restored, passed_over = self._watched(quorum, lambda: self._restore(manager, before_step),
                                                      f"rolled back before step {before_step}")
            except RestoreFailed as failed:
                self.load_failures.failed(failed.step, str(failed).splitlines()[0][:300])
                raise
        if passed_over:
            raise NothingToRestore(
                f"the restore before step {before_step} found no checkpoint that loads: {'; '.join(passed_over)}; "
                "every checkpoint is left as it was")
        if restored is not None:
            self.last_saved = self.last_committed = restored
            for tier in self._rank_tiers().values():
                tier.discard_newer(restored)
        return restored

    def _restore(self, manager: CheckpointManager, before_step: int) -> tuple[int | None, list[str]]:
        """``manager.roll_back(before_step)`` on the checkpoint group; with nothing restored, the committed
        checkpoints before ``before_step`` that were passed over (``LoadFailures``), newest first, as its first
        member finds them (it chose), broadcast."""
        restored = manager.roll_back(before_step)
        if restored is not None:
            return restored, []
        passed_over = [self.load_failures.passed_over(
            [info.step for info in reversed(list_checkpoints(manager.root)) if info.committed and info.step < before_step]
        ) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(passed_over, src=0)
        return None, passed_over[0]

    def _held(self, quorum: Quorum, tiers: dict[str, LiveLocalTier]) -> dict[str, dict[int, list[int]]]:
        """Each member's verified steps of each per-rank tier (tier -> rank -> steps), gathered on the
        checkpoint group (made)."""
        parts: list[dict[str, list[int]] | None] = [None] * len(quorum.members)
        dist.all_gather_object(parts, {name: tier.held() for name, tier in tiers.items()})
        return {name: {member: part[name] for member, part in zip(quorum.members, parts)} for name in tiers}

    def _receive_missing(self, quorum: Quorum, tier: LiveLocalTier, point: ResumePoint) -> None:
        """The members that lack the step the job resumes from receive it from their sources (replicas of
        their shards: ``LiveLocalTier.exchange`` on the checkpoint group), before anyone loads it; the
        quorum's first member says who received it from whom, each receiver what it received."""
        started = time.perf_counter()
        received = self._watched(quorum, lambda: tier.exchange(point.step, point.sources, quorum.index),
                                 f"received the {tier.tier} tier's step {point.step} from its replicas")
        source = dict(point.sources).get(self.rank)
        if source is not None:
            self.events.emit("local_recovered", step=point.step, bytes=received,
                             seconds=time.perf_counter() - started, sources=[source], tier=tier.tier)
        if quorum.index(self.rank) == 0:
            log.info("live run: the %s tier's step %d received from a replica of the same shard by the ranks "
                     "that lacked it: %s", tier.tier, point.step,
                     ", ".join(f"rank {rank} from rank {replica}" for rank, replica in point.sources))

    def save(self, quorum: Quorum, step: int, health: dict | None = None, *, last_step: bool, stopping: bool,
             check: Callable[[dict | None], dict | None] | None = None) -> bool:
        """Saves ``step`` (the number of committed steps) to the tiers the policy names; every member of
        the quorum calls it at the same boundary, with the same ``health`` (``guards.health``: the record of
        the manifest and ``health_ckpts.json``, None when not monitored). True when the durable tier saved. An async durable
        save returns once staged; the job's last save and a stop's return once committed, as does one
        of them already saved and still in flight. The per-rank tiers write this rank's state now. ``check``:
        the replicas' check before a durable save (``LiveFingerprints.before_save``, a collective), given
        ``health``, its answer the health recorded; inside the stall watch's marks of the save, its failure
        the save's."""
        decision = self._due(step, last_step=last_step, stopping=stopping)
        if decision.durable:
            def durable() -> None:
                checked = health if check is None else self._checked(step, check, health)
                self._save_durable(quorum, step, checked, last_step=last_step, stopping=stopping)

            self._marked(quorum, step, durable)
        elif last_step or stopping:  # the process may exit after it: nothing may stay in flight
            self._marked(quorum, step, lambda: self._settle(quorum, step))
        if decision.local or decision.memory:
            state = self.state.state_dict()  # this rank's rows, between steps
            for tier, due in ((self.memory, decision.memory), (self.local, decision.local)):
                if due:
                    tier.save(step, state)
        if self.local is not None and self.wipes is not None and self.wipes.wipe_due(step) and not stopping \
                and step % self.local.interval == 0:  # the local tier's schedule: every member's alike
            self._wipe(quorum, step)
        return decision.durable

    def _wipe(self, quorum: Quorum, step: int) -> None:
        """The drill's ``wipe`` due after the local save of ``step``: the first member of the node it names
        deletes the node's local directories, every member held at a barrier before (no rank is mid-write
        as they go) and after (none runs on before they are gone). The async durable save in flight is
        settled first: its thread's collectives run on the same group."""
        self._settle(quorum, step)
        self.local.wait()  # no retention thread deleting in a directory while it goes
        node, ranks_per_node = self.local.node, self.local.ranks_per_node
        first = min(member for member in quorum.members if node_of(member, ranks_per_node) == node)  # this rank's node's

        self._manager(quorum, f"made its checkpoint group for the drill's wipe after step {step}")

        def wipe() -> None:
            dist.barrier()
            self.wipes.after_local_save(step, node, self.rank == first, self.local.node_dirs())
            dist.barrier()

        self._watched(quorum, wipe, f"held at the drill's wipe after step {step}")

    def _marked(self, quorum: Quorum, step: int, save: Callable[[], None]) -> None:
        """``save()`` between the stall watch's marks of the save of ``step``: every collective of it (the
        group's exchange, the checkpoint group's rendezvous, DCP's, the wait for the commit) inside them. A
        save that raises leaves its mark entered: the epoch is ending, and the watch reads the next one's."""
        if self.marks is not None:
            self.marks.saving(quorum.epoch, step)
        save()
        if self.marks is not None:
            self.marks.saved(quorum.epoch, step)

    def _due(self, step: int, *, last_step: bool, stopping: bool) -> SaveDecision:
        return decide_save(step, save_interval=self.config.save_interval,
                           local_interval=self.local.interval if self.local is not None else 0,
                           last_step=last_step, stopping=stopping, unhealthy=False, durable_saved=self.last_saved,
                           local_saved=self.local.last_saved if self.local is not None else None,
                           memory_interval=self.memory.interval if self.memory is not None else 0,
                           memory_saved=self.memory.last_saved if self.memory is not None else None)

    def _save_durable(self, quorum: Quorum, step: int, health: dict | None, *, last_step: bool,
                      stopping: bool) -> None:
        final = last_step or stopping  # the process may exit after it: nothing may stay in flight
        self._settle(quorum, step)  # at most one save in flight
        manager = self._as_save_failure(step, lambda: self._manager(quorum, f"made its checkpoint group to save step {step}"))
        live = {"epoch": quorum.epoch, "members": quorum.members, "group_size": self.group_size,
                "replica_groups": len(quorum.members) // self.group_size}
        committed_now = final or not self.config.async_save

        def save() -> None:
            manager.save(step, {"step": step, "live": live}, health, last_step=last_step, stopping=stopping)
            if final:
                manager.close()  # committed on every member, the mirror drained, before the process may exit
            elif committed_now:
                manager.wait_for_saves()  # committed on every member before any steps on
            else:
                manager.wait_for_staging()  # the whole state copied before this rank holds its rows again

        with self.whole():
            self._as_save_failure(step, lambda: self._watched(quorum, save, f"saved step {step}"))
        self.last_saved = step
        if committed_now:
            self.last_committed = step
        else:
            self.in_flight = step

    def save_own(self, step: int) -> LiveLocalTier | None:
        """This rank alone, with no collective and no store (the launcher's death took the store): its state of
        ``step`` committed steps written to its first per-rank tier (the memory tier, else the local one) unless
        that tier holds it already, kept out of retention (which could take away an older step that a replica
        of another shard holds alone). The tier, None when there is none or the durable tier holds ``step``
        committed. The restart's ``--resume auto`` takes the newest step every shard holds on one replica
        (``choose_live_resume``): this one when every shard's ranks of one replica group saved it too."""
        tier = next(iter(self._rank_tiers().values()), None)
        if tier is None or step == self.last_committed:
            return None
        tier.wait()
        if tier.last_saved != step:
            tier.save(step, self.state.state_dict(), prune=False)
        return tier

    def settle(self, quorum: Quorum) -> None:
        """The async save in flight, when the run ends at a step boundary without a save of its own (a
        data-skip abort, a step that failed too often): committed on every member, or abandoned as
        ``_settle`` says, before the process exits. Every member calls it at the same boundary."""
        if self.in_flight is not None:
            self._settle(quorum, self.in_flight)

    def restorable(self) -> set[int]:
        """The steps of the durable checkpoints a restore could still load, read from the durable root (every
        member reads the same shared directory): the committed ones and those being written (the save in
        flight, which commits later). Retention's deletions and a roll back's are gone from it."""
        root = self.run_dir / "checkpoints"
        found = {info.step for info in list_checkpoints(root)} if root.is_dir() else set()
        return found | ({self.in_flight} if self.in_flight is not None else set())

    def _settle(self, quorum: Quorum, step: int) -> None:
        """The async save in flight, before another save of ``step`` or the process's end: waited for until
        committed on every member (a barrier), its failure raised as this save's; or, when its epoch has
        ended by a failure (its abort key is set: a member died or gave up, maybe before handing its
        files over, and its gather would wait for gloo's timeout), abandoned, on every member alike (each
        reads the same keys). An abandoned or failed save's step counts as not saved."""
        if self.in_flight is None:
            return
        pending, self.in_flight = self.in_flight, None
        # any epoch ended by a failure since the save's: one of its members may be the one that died
        if any(self.store.check([abort_key(epoch)]) for epoch in range(self.epoch, quorum.epoch)):
            self.events.emit("live_save_abandoned", step=pending, epoch=self.epoch)
            self.last_saved = self.last_committed
            return
        manager = self.manager  # the epoch's that saved it (a group joined since: every member settles it here)
        try:
            self._as_save_failure(step, lambda: self._watched(quorum, manager.wait_for_saves,
                                                              f"waited for the commit of step {pending}"))
        except BaseException:
            self.last_saved = self.last_committed
            raise
        self.last_committed = pending

    def _checked(self, step: int, check: Callable[[dict | None], dict | None], health: dict | None) -> dict | None:
        """The replicas' check before the durable save of ``step``, a failure of it the save's; an epoch that ends
        in it says so (its collective's own line names no save)."""
        def checked() -> dict | None:
            try:
                return check(health)
            except EpochAborted as error:
                raise EpochAborted(f"{error}: the replicas' check before the durable save of step {step}") from error

        return self._as_save_failure(step, checked)

    @staticmethod
    def _as_save_failure(step: int, work: Callable[[], T]) -> T:
        """``work()``, its failure raised as the ``SaveFailed`` of ``step`` (``EpochAborted`` as it is)."""
        try:
            return work()
        except EpochAborted:
            raise
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            raise SaveFailed(f"the durable save of step {step} failed: {str(error).splitlines()[0][:200]}") \
                from error

    def _watched(self, quorum: Quorum, work: Callable[[], T], doing: str) -> T:
        """``collective.watched``; after a failure the epoch's default group and manager are dropped (a
        thread abandoned in them ends at gloo's timeout; so does a save in flight there, which counts as
        not saved), and the next save makes new ones."""
        try:
            return watched(work, self.store, quorum.epoch, self.beat, doing)
        except BaseException:
            self._forget_epoch()
            raise

    def _forget_epoch(self) -> None:
        """After a failure: the epoch's default group and manager dropped, and the save in flight counted as
        not saved."""
        forget_default_group()
        # a thread abandoned in a store wait holds its client until gloo's timeout (one client serialises
        # its calls): the next group is made on a new one (seen: 30 s before the next save otherwise)
        self.epoch = self.manager = self.connection = None
        if self.in_flight is not None:
            self.in_flight, self.last_saved = None, self.last_committed


def forget_default_group() -> None:
    """Destroys this process's default group, made or not (it blocks on nothing: gloo). Destroying it is
    also what resets torch's count of default groups made, which names the next one in its store keys:
    an ``init_process_group`` abandoned in its rendezvous (a member died meanwhile) raised that count
    and never made a group, so the next group this rank made was named apart from its peers', and they
    waited for each other under different keys until the timeout (seen: every save after a rank was
    killed while the group was being made, 30 s each). With no group, a one-rank group on a local store
    is made to be destroyed."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
    keep_mesh_groups()  # tensor parallel's groups, which destroying unregistered
