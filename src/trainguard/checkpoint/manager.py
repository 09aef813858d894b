"""``CheckpointManager``: durable checkpoints and exact resume for any FSDP2/HSDP/TP training loop.

It owns what a training loop should not have to think about: which checkpoint to resume from (the
newest committed one that verifies), restoring every RNG of every rank, the per-rank extra state of
any object with ``state_dict``/``load_state_dict`` (LR scheduler, data sampler, guards), when each
tier saves (``save(step, last_step=...)``, the policy of ``checkpoint.save_policy``), async saves with
at most one in flight, and retention. It is configured by a ``CheckpointConfig`` (the ``checkpoint``
section of a run's config). Every method is collective.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainguard.checkpoint.discovery import CheckpointInfo, list_checkpoints, write_latest
from trainguard.checkpoint.config import CheckpointConfig, MirrorConfig
from trainguard.checkpoint.durable import DurableCheckpointer
from trainguard.checkpoint.hooks import CheckpointMirror, CommitHook, ResumeSource
from trainguard.fs.fsio import clean_stale, remove_directory_crash_safe
from trainguard.checkpoint.local.tier import LocalTier
from trainguard.checkpoint.manifest import read_manifest
from trainguard.checkpoint.memory_tier import MemoryTier
from trainguard.checkpoint.resume import choose_resume_checkpoint
from trainguard.checkpoint.save_policy import SaveDecision, decide_save
from trainguard.errors import CheckpointError, NoCheckpointError, RestoreFailed, TrainguardError, raised_by_every_rank
from trainguard.events import EventLog
from trainguard.topology.rank_failure import raise_if_any_rank_failed
from trainguard.guards.health import marked_unhealthy
from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state, seed_everything

log = logging.getLogger("trainguard")

Health = dict[str, Any]  # {"is_health": 0|1, "embedding_local_norm": ..., "threshold": ...}; 1 = unhealthy


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _broadcast(value: Any) -> Any:
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _raise_on_every_rank(error: BaseException | None) -> None:
    """Rank 0's ``error``, broadcast to every rank, raised there (a ``TrainguardError`` reported by rank 0 alone)."""
    if error is not None:
        raise raised_by_every_rank(error) if isinstance(error, TrainguardError) else error


class CheckpointManager:
    """Saves to ``RUN_DIR/checkpoints/global_step_N`` and resumes from there.

    ``stateful`` maps names to objects whose state rides along in each rank's extra-state file; it
    must hold only plain data and tensors (it is loaded with ``weights_only=True``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Stateful] | None = None,
        config: CheckpointConfig | None = None,
        *,
        save_interval: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool | None = None,
        resume: str | None = None,
        mirror: MirrorConfig | None = None,
        mesh_shape: list[int] | None = None,
        mesh_dim_names: list[str] | None = None,
        static_files: Callable[[Path], None] | None = None,
        events: EventLog | None = None,
        accept: Callable[[CheckpointInfo], str | None] | None = None,
        after_commit: Callable[[int, Path], None] | None = None,
        seed: int = 0,
        local: LocalTier | None = None,
        memory: MemoryTier | None = None,
    ):
        """``config`` (the ``checkpoint`` section) holds the policy; without one, periodic saves are off.
        ``save_interval`` ... ``mirror`` given as keywords replace the config's fields of that name."""
        given = {"save_interval": save_interval, "keep_last": keep_last, "keep_every": keep_every,
                 "async_save": async_save, "resume": resume, "mirror": mirror}
        config = dataclasses.replace(config or CheckpointConfig(save_interval=0),
                                     **{key: value for key, value in given.items() if value is not None})
        self.config = config
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.model = model
        self.optimizer = optimizer
        self.stateful = dict(stateful or {})
        self.resume_mode = config.resume
        self.static_files = static_files or (lambda directory: None)
        self.accept = accept
        self.seed = seed
        self.local = local
        self.memory = memory
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.events = events or EventLog(self.run_dir / "events.jsonl", rank=self.rank, host=socket.gethostname())
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in clean_stale(self.root):
                # an earlier run's, or (live mode, a manager per quorum) a save abandoned when a rank died
                log.warning("removed an unfinished checkpoint, a save that never committed: %s", stale)
        # One token per incarnation names the temporary directory that all ranks write into.
        run_token = _broadcast(uuid.uuid4().hex[:12] if self.rank == 0 else None)
        self.mirror: CheckpointMirror | None = None
        """Copies of committed checkpoints elsewhere (rank 0): ``config.mirror`` is acted on by
        ``trainguard.backup.attach.attach_mirror(manager)``, which sets this (the tiers do not import backup)."""
        self.resume_source: ResumeSource | None = None
        """Restores a resume mode naming a mirror URL (rank 0), set by ``attach_mirror``."""
        self.commit_hooks: list[CommitHook] = [after_commit] if after_commit is not None and self.rank == 0 else []
        """Called in order on rank 0 after each durable commit."""
        self.durable = DurableCheckpointer(
            self.root,
            rank=self.rank,
            world_size=self.world_size,
            mesh_shape=mesh_shape or [self.world_size],
            mesh_dim_names=mesh_dim_names or ["world"],
            run_token=run_token,
            process_group=dist.new_group(backend="gloo") if dist.is_initialized() else None,
            async_save=config.async_save,
            keep_last=config.keep_last,
            keep_every=config.keep_every,
            events=self.events,
            commit_hooks=self.commit_hooks,
            protected=lambda: self.mirror.pending_steps() if self.mirror is not None else set(),
            writer=config.writer,
        )
        if config.save_interval:
            # a writer process's interpreter starts beside the run's own start, not in its first save
            self.durable.files.start()
        self.last_saved_step: int | None = None
        """The step the durable tier last saved (or the run resumed from)."""
        self.last_local_step: int | None = None
        self.last_memory_step: int | None = None
        self.resumed_from: str | None = None
        """The checkpoint ``resume()`` restored, None when the run started fresh."""

    def resume(self) -> int:
        """Restores the chosen checkpoint (if any) and returns the step to continue after (0 if fresh)."""
        error = path = None
        if self.rank == 0:
            try:
                mode = self.resume_mode
                if self.resume_source is not None:  # a mirror URL: restored into the run's checkpoints first
                    mode = self.resume_source(mode, self.root)
                chosen = choose_resume_checkpoint(mode, self.root, warn=log.warning, accept=self.accept)
                path = str(chosen) if chosen else None
            except Exception as exc:  # every rank must learn of it, or the others wait in broadcast for ever
                error = exc
        path, error = _broadcast((path, error))
        if self.resume_mode == "auto":
            # the newest state recoverable from any tier (also when no durable one is usable); at the
            # same step a per-rank one (no shared storage); the memory tier first, as it saves most often
            durable_step = read_manifest(Path(path)).step if path is not None else None
            for tier in self._rank_tiers():
                recovered = tier.recover(self.model, self.optimizer, newer_than=(
                    durable_step - 1 if durable_step is not None else None))
                if recovered is not None:
                    return self._resume_from_local(*recovered, tier=tier)
        _raise_on_every_rank(error)
        if path is None:
            for tier in self._rank_tiers():
                tier.discard_newer(0)
            if self.rank == 0:
                self.events.emit("run_started", step=0, resumed_from=None)
            return 0
        started = time.perf_counter()
        failure = None
        try:
            step = self._load_durable(Path(path))
        except TrainguardError as exc:  # e.g. a file refused as unsafe on this rank only
            if exc.every_rank_raises:  # DCP already told every rank of it
                raise
            failure = exc
        raise_if_any_rank_failed(failure)
        seconds = time.perf_counter() - started
        log.info("resumed from %s at step %d (%.2fs)", path, step, seconds)
        if self.rank == 0:
            self.events.emit("run_started", step=step, resumed_from=path, load_seconds=seconds)
        self.last_saved_step = step
        self.resumed_from = path
        return step

    def _load_durable(self, path: Path) -> int:
        """Loads a durable checkpoint into the model, optimizer, stateful objects and RNGs; returns its step.
        The local tier's newer steps are dropped: they belong to a timeline that is not continued."""
        manifest = read_manifest(path)
        extra = self.durable.load(path, self.model, self.optimizer, source_world_size=manifest.world_size)
        for name, obj in self.stateful.items():
            if name in extra["stateful"]:
                obj.load_state_dict(extra["stateful"][name])
        absent = [name for name in self.stateful if name not in extra["stateful"]]
        if absent and self.rank == 0:  # once per job: these objects go on from their own state, not the run's
            log.warning("resuming from %s: it holds no state for %s (saved without them); they start from their "
                        "initial state", path, ", ".join(repr(name) for name in absent))
        step = int(extra["step"])
        for tier in self._rank_tiers():
            tier.discard_newer(step)
        if "rng" not in extra:
            pass  # converted from Hugging Face weights (trainguard.hf.convert): the fresh seeds stand
        elif manifest.world_size == self.world_size:
            restore_rng_state(extra["rng"])
        else:
            log.warning("world size changed from %d to %d: RNG states are reseeded per rank",
                        manifest.world_size, self.world_size)
            seed_everything(self.seed * 1000 + self.rank + step)
        return step

    def _rank_tiers(self) -> list[LocalTier | MemoryTier]:
        """The per-rank tiers, newest first: the memory tier, then the local tier."""
        return [tier for tier in (self.memory, self.local) if tier is not None]

    def _resume_from_local(self, step: int, extra: dict[str, Any], tier: LocalTier | MemoryTier) -> int:
        for name, obj in self.stateful.items():
            if name in extra["stateful"]:
                obj.load_state_dict(extra["stateful"][name])
        restore_rng_state(extra["rng"])
        for other in self._rank_tiers():
            other.discard_newer(step)
        self.last_local_step = self.last_memory_step = step
        name = "memory" if tier is self.memory else "local"
        log.info("resumed from the %s tier at step %d (%s)", name, step, tier.dir)
        if self.rank == 0:
            self.events.emit("run_started", step=step, resumed_from=str(tier.dir / f"global_step_{step}"),
                             tier=name)
        self.last_saved_step = step
        return step

    def save_local(self, step: int) -> None:
        """Writes this rank's local-tier checkpoint of ``step`` now (synchronously, no collective but the
        extra state's hand-over to its buddy)."""
        assert self.local is not None
        self.local.save(step, self.model, self.optimizer, self._extra_state(step))
        self.last_local_step = step

    def save_memory(self, step: int) -> bool:
        """Starts this rank's memory-tier save of ``step``; returns before the state is copied (the
        next optimizer step waits for the copy, as after an async durable save). False: skipped, the
        previous step's write still running on a rank (``MemoryTier.save``)."""
        assert self.memory is not None
        saved = self.memory.save(step, self.model, self.optimizer, self._extra_state(step))
        if saved:
            self.last_memory_step = step
        return saved

    def _extra_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "rng": capture_rng_state(),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
        }

    def due(self, step: int, *, last_step: bool = False, stopping: bool = False,
            unhealthy: bool = False) -> SaveDecision:
        """Which tiers ``save`` would write for this step (the policy of ``checkpoint.save_policy``)."""
        return decide_save(step, save_interval=self.config.save_interval,
                           local_interval=self.local.interval if self.local is not None else 0,
                           last_step=last_step, stopping=stopping, unhealthy=unhealthy,
                           durable_saved=self.last_saved_step, local_saved=self.last_local_step,
                           memory_interval=self.memory.interval if self.memory is not None else 0,
                           memory_saved=self.last_memory_step)

    def save(self, step: int, trainer_state: dict[str, Any] | None = None,
             health: Health | Callable[[], Health | None] | None = None, *,
             last_step: bool = False, stopping: bool = False) -> float | None:
        """Saves ``step`` to the tiers the policy names (``due``); returns the seconds the durable save
        blocked, None when it did not save. Collective: every rank calls it at every step.

        ``last_step``: the last step of the schedule (saved when periodic saves are on); ``stopping``:
        the process stops after this step and the run goes on later (always saved, durable tier only).
        ``health`` (``{"is_health": 0|1, ...}``, 1 = unhealthy, or a function returning it, called
        once and only when a tier saves) goes into the manifest and ``health_ckpts.json``; ``auto``
        resume never picks an unhealthy checkpoint, and the local and memory tiers never save one.
        """
        decision = self.due(step, last_step=last_step, stopping=stopping)
        if not decision:
            return None
        record = health() if callable(health) else health
        if marked_unhealthy(record):
            decision = self.due(step, last_step=last_step, stopping=stopping, unhealthy=True)
        blocked = None
        if decision.durable:
            blocked = self.save_durable(step, trainer_state, record)
        if decision.local:
            self.save_local(step)
        if decision.memory:
            self.save_memory(step)
        return blocked

    def save_durable(self, step: int, trainer_state: dict[str, Any] | None = None,
                     health: Health | None = None) -> float:
        """Stages a durable checkpoint of ``step`` now and commits it in the background; returns the
        seconds blocked, the wait for the previous save to commit included."""
        extra = self._extra_state(step)
        blocked = self.durable.save(step, self.model, self.optimizer, extra, trainer_state or {"step": step},
                                    self.static_files, health=health)
        self.last_saved_step = step
        if blocked.waiting >= 0.001:
            log.info("checkpoint global_step_%d staged (blocked %.0fms, %.0fms of it waiting for the previous save "
                     "to commit)", step, blocked.total * 1000, blocked.waiting * 1000)
        else:
            log.info("checkpoint global_step_%d staged (blocked %.0fms)", step, blocked.total * 1000)
        return blocked.total

    def wait_for_staging(self) -> float:
        """Blocks until the state of the saves in flight is copied (an async save, and a memory-tier
        save, copy it while the next forward and backward run); returns the seconds blocked. Call it
        before anything changes parameters or optimizer state in place; ``optimizer.step()`` calls it
        by itself (a step pre-hook)."""
        return self.durable.wait_for_staging() + (self.memory.wait_for_staging() if self.memory is not None else 0.0)

    def close(self) -> None:
        """Waits until the last save is committed on every rank, then drains the mirror's queue."""
        self.wait_for_saves()
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def wait_for_saves(self) -> None:
        """Waits until the saves in flight are committed on every rank (a barrier); re-raises a save's
        failure. Unlike ``close`` the mirror goes on."""
        self.durable.wait()
        for tier in self._rank_tiers():
            tier.wait()
        if dist.is_initialized():
            dist.barrier()

    def roll_back(self, before_step: int) -> int | None:
        """Rollback mode: restores the newest healthy, verified checkpoint of a step before
        ``before_step`` and returns its step (None when there is none; nothing is changed then).

        Waits for the save in flight first (the mirror keeps running). The newer checkpoints belong to the timeline being
        abandoned: once the restore has loaded they are deleted (newest first) and
        ``latest_checkpointed_iteration.txt`` points at the restored one again, so a later restart resumes on
        the new timeline, not the old one. A load that fails (``RestoreFailed``, naming the checkpoint) deletes
        nothing: a caller that passes over a checkpoint that will not load for an older one, and finds none
        that loads, leaves every checkpoint as it was.
        """
        self.wait_for_saves()
        error = path = None
        if self.rank == 0:
            try:
                def before(info: CheckpointInfo) -> str | None:
                    if info.step >= before_step:
                        return f"not before the spike at step {before_step} (rolled back)"
                    return self.accept(info) if self.accept is not None else None

                try:
                    chosen = choose_resume_checkpoint("auto", self.root, warn=log.info, accept=before)
                except NoCheckpointError:  # all of them rejected: nothing to roll back to
                    chosen = None
                if chosen is not None:
                    path = str(chosen)
            except Exception as exc:  # every rank must learn of it, or the others wait in broadcast for ever
                error = exc
        path, error = _broadcast((path, error))
        _raise_on_every_rank(error)
        if path is None:
            return None
        step = self._restore(Path(path))
        if self.rank == 0:
            try:
                self._abandon_after(step)
            except Exception as exc:
                error = exc
        _raise_on_every_rank(_broadcast(error))
        self.last_saved_step = step
        self.last_local_step = self.last_memory_step = None  # their steps after it are gone; the next saves are newer
        return step

    def _restore(self, path: Path) -> int:
        """A rollback's load of ``path`` (verified): its step; a failure of the load, on every rank (DCP's) or on
        this rank alone (its extra state), raised by every rank alike as ``RestoreFailed``. A collective."""
        failure: TrainguardError | None = None
        try:
            step = self._load_durable(path)
        except CheckpointError as exc:
            failure = exc
        if failure is None or not failure.every_rank_raises:  # the others learn of this rank's own failure
            try:
                raise_if_any_rank_failed(failure)
            except TrainguardError as exc:
                failure = exc
        if failure is not None:
            raise RestoreFailed(int(read_manifest(path).step), failure) from failure
        return step

    def _abandon_after(self, step: int) -> None:
        if self.mirror is not None:  # first, so that no upload of an abandoned step starts after this
            self.mirror.abandon_after(step)
        for info in reversed(list_checkpoints(self.root)):
            if info.step <= step:
                break
            if not info.being_written:
                remove_directory_crash_safe(info.path)
                self.events.emit("checkpoint_deleted", step=info.step, reason="abandoned by a rollback",
                                 tier="durable")
        write_latest(self.root, step)
