"""The durable tier in live mode: ``CheckpointManager``'s DCP checkpoints (``global_step_N/``, committed
with a manifest), saved by every rank of the current quorum at a step boundary they all reached, and the
resume of a whole job from the newest verified one (``checkpoint.resume``, ``auto`` by default).

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
``CheckpointManager`` bound to it, both kept until the quorum changes. The save is synchronous: it
is over before the next step starts. It runs ``collective.watched``: the rank beats meanwhile (a long
save is not a hang) and watches the epoch's abort key, because DCP's collectives do not: a member
waiting in one on a peer that died, or that gave up, would wait for gloo's timeout. A save that fails
or is aborted ends the epoch like any failed collective (the group is dropped, the save's thread
abandoned); the step stays committed and the next save boundary saves again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.save_policy import decide_save
from trainguard.events import EventLog
from trainguard.live.collective import EpochAborted, watched
from trainguard.live.quorum import Quorum
from trainguard.live.state import LiveState

T = TypeVar("T")
REPLICA_DIMS = ["dp_replicate", "dp_shard"]  # the manifest's mesh: replica groups of the quorum x their ranks


class SaveFailed(RuntimeError):
    """A durable save of the quorum failed: handled as a failed collective (the epoch ends)."""


class LiveCheckpoints:
    """One rank's durable tier in a live run: ``resume`` at the start of a job, ``save`` after each
    committed step (the policy of ``CheckpointManager.save``: every ``save_interval`` steps, the last
    step, and before a stop)."""

    def __init__(self, store: dist.TCPStore, run_dir: Path, config: CheckpointConfig, rank: int,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, group_size: int,
                 whole: Callable[[], AbstractContextManager[None]], state: LiveState, events: EventLog,
                 timeout: timedelta, beat: Callable[[], None], static_files: Callable[[Path], None] | None = None):
        # synchronous: the save must be over before the quorum can change (an async save's background
        # collectives would outlive the epoch whose group they use)
        self.config = dataclasses.replace(config, async_save=False)
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
        # the step this rank last saved or resumed from: kept across epochs (each epoch's manager is new)
        self.last_saved: int | None = None

    def _manager(self, quorum: Quorum) -> CheckpointManager:
        if self.epoch == quorum.epoch:
            return self.manager
        forget_default_group()  # an older epoch's (idle: no save is in flight between steps), or none
        if self.connection is None:
            # the group's setup blocks on the store until every member connected: on the rank's own
            # client it would hold up the beats of ``watched`` behind it (one client serialises its calls)
            self.connection = dist.TCPStore(self.store.host, self.store.port, is_master=False, timeout=self.timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ckpt/{quorum.epoch}", self.connection),
                                rank=quorum.index(self.rank), world_size=len(quorum.members), timeout=self.timeout)
        groups = len(quorum.members) // self.group_size
        self.manager = CheckpointManager(self.run_dir, self.model, self.optimizer, self.state.checkpointed(),
                                         config=self.config, events=self.events, static_files=self.static_files,
                                         mesh_shape=[groups, self.group_size], mesh_dim_names=REPLICA_DIMS)
        self.epoch = quorum.epoch
        return self.manager

    def resume(self, quorum: Quorum, checkpoint: Path) -> int:
        """Every member of a job's first epoch: loads ``checkpoint`` (the launcher chose it, by
        ``checkpoint.resume``, before starting the ranks), verified again, and returns its step."""
        self.config = dataclasses.replace(self.config, resume=str(checkpoint))
        with self.whole():
            step = self._watched(quorum, lambda: self._manager(quorum).resume(), f"resumed from {checkpoint}")
        self.last_saved = step
        return step

    def save(self, quorum: Quorum, step: int, health: dict | None = None, *, last_step: bool, stopping: bool) -> bool:
        """Saves ``step`` (the number of committed steps) if the policy says so; every member of the
        quorum calls it at the same boundary, with the same ``health`` (``guards.health``: the record of the
        manifest and ``health_ckpts.json``, None when not monitored). True when it saved."""
        # the policy first: the checkpoint group and its manager are made for a save that is due only
        if not decide_save(step, save_interval=self.config.save_interval, local_interval=0, last_step=last_step,
                           stopping=stopping, unhealthy=False, durable_saved=self.last_saved,
                           local_saved=None).durable:
            return False
        manager = self._watched(quorum, lambda: self._manager(quorum),
                                f"made its checkpoint group to save step {step}")
        live = {"epoch": quorum.epoch, "members": quorum.members, "group_size": self.group_size,
                "replica_groups": len(quorum.members) // self.group_size}

        def save_and_commit() -> None:
            manager.save(step, {"step": step, "live": live}, health, last_step=last_step, stopping=stopping)
            manager.close()  # committed on every member before any steps on

        try:
            with self.whole():
                self._watched(quorum, save_and_commit, f"saved step {step}")
        except EpochAborted:
            raise
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            raise SaveFailed(f"the durable save of step {step} failed: {str(error).splitlines()[0][:200]}") \
                from error
        self.last_saved = step
        return True

    def _watched(self, quorum: Quorum, work: Callable[[], T], doing: str) -> T:
        """``collective.watched``; after a failure the epoch's default group and manager are dropped (a
        thread abandoned in them ends at gloo's timeout), and the next save makes new ones."""
        try:
            return watched(work, self.store, quorum.epoch, self.beat, doing)
        except BaseException:
            forget_default_group()
            # a thread abandoned in a store wait holds its client until gloo's timeout (one client serialises
            # its calls): the next group is made on a new one (seen: 30 s before the next save otherwise)
            self.epoch = self.manager = self.connection = None
            raise


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
