"""The durable tier: torch.distributed.checkpoint (DCP) saves with an atomic commit.

Protocol (what makes a crash at any instant harmless):
1. every rank writes into ``global_step_N.tmp-<run token>/``: its DCP shard and its extra state,
   hashing each file as it writes it (no file is read back) and fsyncing it;
2. DCP's own finish step gathers all ranks' write results (rank 0 then writes ``.metadata``); each
   rank then sends its files' checksums to rank 0 over the checkpoint's own process group, so once
   rank 0 has them all, every rank's files are on disk;
3. rank 0 hashes the files it wrote itself (``.metadata``, static files) and commits the directory
   (``checkpoint.commit``: ``trainguard.json`` last, renamed to ``global_step_N``, health recorded,
   only then ``latest_checkpointed_iteration.txt``);
4. retention deletes old checkpoints by renaming them out of the namespace first; then the commit
   hooks run (the mirror's upload queue, fault drills).
At most one save is in flight: a new save first waits for the previous commit. An async save copies
the state into staging buffers reused from save to save (``ReusableStager``) in the background, while
the next forward and backward run (``LazySnapshot``): ``save`` returns before the copy, and the next
optimizer step waits for what is left of it (``wait_for_staging``, also a step pre-hook on the
optimizer); the temporary directory, the extra state's serialisation, writing, gathering and
committing then run in the saver's background thread (``BackgroundWorker``), the only user of the
checkpoint's own process group.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.futures import Future

from trainguard.checkpoint.background import BackgroundWorker
from trainguard.checkpoint.commit import Committed, commit_checkpoint
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.disk_full import disk_full_error, is_disk_full, tensor_bytes
from trainguard.checkpoint.dcp_writer import SaveJob, gather_entries, write_rank_files
from trainguard.checkpoint.hooks import CommitHook
from trainguard.checkpoint.manifest import build_manifest, read_manifest
from trainguard.checkpoint.retention import retention_after_commit
from trainguard.checkpoint.safe_load import describe_error, load_dcp_metadata, safe_torch_load, weights_only_refusal
from trainguard.checkpoint.snapshot import LazySnapshot, StagingGate
from trainguard.checkpoint.staging import ReusableStager, detached, serialised
from trainguard.checkpoint.state_capture import CaptureCache
from trainguard.checkpoint.state_dict import STATE_DICT_OPTIONS, training_state
from trainguard.checkpoint.writer_process import allocator_for, make_writer, writer_died
from trainguard.errors import CheckpointError, UnsafeCheckpointError, raised_by_every_rank
from trainguard.events import EventLog
from trainguard.fs.fsio import delete_retired, retire_directory
from trainguard.fs.layout import HEALTH_FILE, extra_state_name, parse_step_dir, step_dir_name, temp_dir_name
from trainguard.guards.health import marked_unhealthy, unhealthy_names


def _marked_unhealthy(ckpt_dir: Path) -> bool:
    try:
        health = read_manifest(ckpt_dir).health
    except CheckpointError:
        return True  # unreadable: not a checkpoint worth protecting
    return marked_unhealthy(health)


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, except that ``.metadata`` is unpickled with an allow-list, never plainly, and a
    shard file that fails to load is named in one line (DCP's own error is a traceback of every rank)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = load_dcp_metadata(Path(self.path) / ".metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any):
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            path = Path(self.path) / relative_path
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner)
            except pickle.UnpicklingError as exc:
                raise weights_only_refusal(path, exc) from None
            except Exception as exc:  # truncated, foreign or mismatched records fail in many ways
                raise CheckpointError(f"cannot load {path}: {describe_error(exc)}") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_at_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@dataclasses.dataclass(frozen=True)
class Blocked:
    """What one save cost the training loop, in seconds."""

    total: float  # from the call until the loop may go on, the wait for the previous save included
    waiting: float  # of it, waiting for the previous save to commit (at most one save is in flight)


def set_at_path(root: Any, path: Sequence[Any], value: Any) -> None:
    """``root[path[0]][path[1]]...[path[-1]] = value``: puts a flattened key's value back where the
    (unflattened) state dict being loaded holds it (DCP's own helper for this is private)."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


class DurableCheckpointer:
    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        mesh_shape: list[int],
        mesh_dim_names: list[str],
        run_token: str,
        process_group: dist.ProcessGroup | None,
        async_save: bool,
        keep_last: int,
        keep_every: int | None,
        events: EventLog,
        commit_hooks: Sequence[CommitHook] = (),
        protected: Callable[[], set[int]] | None = None,
        writer: str = "thread",
    ):
        """``commit_hooks`` are called in order on rank 0 after each commit (and after retention); a
        list given here is read at each commit, so hooks appended to it later are called too.
        ``writer`` (``checkpoint.writer``): where async saves serialise, hash and write their files,
        ``"process"`` (a writer process of this rank) or ``"thread"`` (the save's background thread)."""
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.mesh_dim_names = mesh_dim_names
        self.run_token = run_token
        self.process_group = process_group
        self.async_save = async_save
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.events = events
        self.commit_hooks = commit_hooks
        self.protected = protected  # steps retention must keep for now (e.g. waiting for their mirror upload)
        self._background = BackgroundWorker("trainguard-durable-save")
        self._inflight: threading.Event | None = None
        self._error: BaseException | None = None
        self.files = make_writer(writer if async_save else "thread", "durable")
        """What writes the files of a save: the writer process of async saves, or this process."""
        self.capture = CaptureCache(training_state, ReusableStager(allocator_for(self.files)))
        """The staging plan of async saves, with its reused buffers (``capture.stager``)."""
        self._gate = StagingGate()

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_state: dict[str, Any],
        trainer_state: dict[str, Any],
        write_static_files: Callable[[Path], None],
        *,
        health: dict[str, Any] | None = None,
    ) -> Blocked:
        """Stages the state and starts writing it; returns what the caller was blocked, the wait for
        the previous save to commit included (a save every few seconds on slow storage waits for it).

        ``health`` (``{"is_health": 0|1, ...}``, 1 = unhealthy), when given, goes into the manifest
        and, once committed, into ``health_ckpts.json`` (rank 0).
        """
        called = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        tmp = self.root / temp_dir_name(step, self.run_token)
        if self.async_save:
            # The previous save's write is over (wait() above), so its buffers may be overwritten. The
            # copy into them is made in the background, until the next optimizer step (wait_for_staging);
            # so are the extra state's serialisation (from a copy taken now: the caller may change its
            # objects as soon as save() returns), the temporary directory and the static files.
            extra = detached(extra_state)
            capture = self.capture.take(model, optimizer)
            plan = capture.plan
            snapshot = LazySnapshot(capture.split)
            self._gate.hold(snapshot, optimizer)
            blocked = Blocked(time.perf_counter() - called, started - called)
            self._saved(step, blocked)  # before the background part starts: it precedes the commit's event
            prepare = functools.partial(self._prepare, step, tmp, extra, trainer_state, started, health,
                                        write_static_files)
            self._inflight = self._background.run(self._finish_guarded, snapshot, plan.staged, prepare)
        else:
            job = self._prepare(step, tmp, extra_state, trainer_state, started, health, write_static_files)
            retired = self._finish_or_say_full(training_state(model, optimizer), job)
            blocked = Blocked(time.perf_counter() - called, started - called)
            self._saved(step, blocked)
            if retired:
                # The checkpoints retention retired are gone for every reader (renamed); making that
                # durable and deleting their files (for big files, longer than the commit:
                # benchmarks/hf_trainer_save.py) is left to the background thread, which the next save
                # waits for before it writes. A crash before it keeps them whole, as if not yet retired.
                self._inflight = self._background.run(self._delete_guarded, retired)
        return blocked

    def _saved(self, step: int, blocked: Blocked) -> None:
        if self.rank == 0:  # here, in the step's order of events (docs/events.md)
            self.events.emit("checkpoint_saved", step=step, blocked_s=blocked.total,
                             waiting_for_previous_s=blocked.waiting, async_save=self.async_save)

    def _prepare(self, step: int, tmp: Path, extra_state: dict[str, Any], trainer_state: dict[str, Any],
                 started: float, health: dict[str, Any] | None,
                 write_static_files: Callable[[Path], None]) -> SaveJob:
        """The save's temporary directory, its extra state serialised, and (rank 0) its static files."""
        tmp.mkdir(parents=True, exist_ok=True)
        job = SaveJob(step, tmp, trainer_state, started, tmp / extra_state_name(self.world_size, self.rank),
                      serialised(extra_state), health)
        if self.rank == 0:
            write_static_files(tmp)
        return job

    def wait_for_staging(self) -> float:
        """Blocks until the live parameters and optimizer state may change again (the copy of the save
        in flight is made; this thread helps with what is left); returns the seconds it blocked.
        ``optimizer.step()`` calls it by itself (a step pre-hook), and ``wait()`` does."""
        return self._gate.wait()

    def in_flight(self) -> bool:
        """Whether a save's background part (writing, gathering, committing) is still running."""
        return self._inflight is not None and not self._inflight.is_set()

    def wait(self) -> None:
        """Blocks until the in-flight save is committed; re-raises its failure."""
        self.wait_for_staging()
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _finish_guarded(self, snapshot: LazySnapshot, state: dict[str, Any], prepare: Callable[[], SaveJob]) -> None:
        try:
            job = prepare()
            snapshot.copied()
            delete_retired(self._finish_or_say_full(state, job))
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc

    def _delete_guarded(self, retired: list[Path]) -> None:
        try:
            delete_retired(retired)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc

    def _finish_or_say_full(self, state: dict[str, Any], job: SaveJob) -> list[Path]:
        """``_finish``, its disk-full failure said in one line."""
        try:
            return self._finish(state, job)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            died = writer_died(exc)
            if died is not None:
                raise died from None
            if not is_disk_full(exc):
                raise
            previous = [info for info in list_checkpoints(self.root) if info.committed]
            # the previous checkpoint's size, else this rank's share of tensors times the ranks
            needed = previous[-1].manifest.total_size if previous and previous[-1].manifest else \
                tensor_bytes(state) * self.world_size
            raise disk_full_error(self.root, job.step, needed) from None

    def _finish(self, state: dict[str, Any], job: SaveJob) -> list[Path]:
        """Writes this rank's files and (rank 0) commits the checkpoint; returns the directories retention
        retired (rank 0), to be deleted (``fsio.delete_retired``)."""
        # A sync save's loop waits for the whole write: through the page cache (writeback started as
        # each 16 MiB is complete, one fsync at the end) it ends sooner than direct writes, which wait
        # for the device buffer by buffer (benchmarks/hf_trainer_save.py). An async save's loop waits
        # for none of it, and direct writes take less CPU from the training beside it.
        entries, failure = write_rank_files(state, job, self.process_group, self.files, direct=self.async_save)
        known = gather_entries(job, entries, failure, rank=self.rank, world_size=self.world_size,
                               process_group=self.process_group)
        if self.rank != 0:
            return []
        manifest = build_manifest(
            job.tmp,
            step=job.step,
            world_size=self.world_size,
            mesh_shape=self.mesh_shape,
            mesh_dim_names=self.mesh_dim_names,
            trainer_state=job.trainer_state,
            health=job.health,
            known=known,
        )
        # A committed directory of this step was left by a timeline this run resumed before (passed over
        # as bad, or newer than the resume point): the step is being redone, and the new one is the
        # checkpoint of record.
        # DCP's ``.metadata`` stays out of ``fsynced``: DCP does not fsync it (``sync_files=False``), the
        # seal does.
        committed = commit_checkpoint(job.tmp, manifest, fsynced=known, replace=True)
        return self._after_commit(committed, time.perf_counter() - job.started)

    def _after_commit(self, committed: Committed, seconds: float) -> list[Path]:
        """What follows a commit on rank 0: its events, retention, then the commit hooks; returns the
        directories retention retired (renamed, to be deleted: ``fsio.delete_retired``)."""
        step = committed.manifest.step
        if committed.replaced:
            self.events.emit("checkpoint_deleted", step=step, reason="replaced by a redone step", tier="durable")
        self.events.emit(
            "checkpoint_committed",
            step=step,
            path=str(committed.path),
            bytes=committed.manifest.total_size,
            seconds=seconds,
            tier="durable",
        )
        retired = self._apply_retention(step)
        for hook in self.commit_hooks:
            hook(step, committed.path)
        return retired

    def _apply_retention(self, committed: int) -> list[Path]:
        """Retires (``fsio.retire_directory``) the checkpoints the policy drops; returns their new names."""
        steps = [s for s in (parse_step_dir(p.name) for p in self.root.iterdir()) if s is not None]
        recorded = unhealthy_names(self.root / HEALTH_FILE)
        unhealthy = [s for s in steps if s <= committed and (step_dir_name(s) in recorded
                                                             or _marked_unhealthy(self.root / step_dir_name(s)))]
        keep = self.protected() if self.protected is not None else set()
        retired = []
        for step in retention_after_commit(steps, committed, unhealthy, self.keep_last, self.keep_every):
            if step in keep:
                continue
            retired.append(retire_directory(self.root / step_dir_name(step)))
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="durable")
        return retired

    def load(
        self, ckpt_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, source_world_size: int
    ) -> dict[str, Any]:
        """Loads model and optimizer (resharding as needed) and returns this rank's extra state.

        After a change of world size the per-rank extra state has no owner; rank 0's copy still holds
        the global facts (step, data position, LR schedule).
        """
        metadata = load_dcp_metadata(Path(ckpt_dir))  # refuse unsafe metadata with our one-line error, not DCP's
        if has_optimizer_state(metadata):
            model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
            state = {"model": model_sd, "optim": optim_sd}
        else:  # saved before any optimizer step: the optimizer starts fresh, as it did then
            state = {"model": get_model_state_dict(model, options=STATE_DICT_OPTIONS)}
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(ckpt_dir),
                planner=SafeLoadPlanner(),
                process_group=self.process_group,
            )
        except BaseException as exc:  # DCP's CheckpointException (every rank raises it) is a BaseException
            raise _dcp_load_failure(exc, ckpt_dir, distributed=dist.is_initialized()) from None
        if "optim" in state:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=STATE_DICT_OPTIONS)
        else:
            set_model_state_dict(model, state["model"], options=STATE_DICT_OPTIONS)
        if source_world_size == self.world_size:
            return safe_torch_load(Path(ckpt_dir) / extra_state_name(self.world_size, self.rank))
        return safe_torch_load(Path(ckpt_dir) / extra_state_name(source_world_size, 0))


def has_optimizer_state(metadata: Any) -> bool:
    """Whether a checkpoint's DCP metadata holds optimizer state (none before the first optimizer step)."""
    return any(key.startswith("optim.") for key in metadata.state_dict_metadata)


class _SafeEmptyStateDictLoadPlanner(SafeLoadPlanner):
    """Builds the state dict from the checkpoint's own metadata (offline, no model needed)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                state_dict[key] = torch.empty(item.size, dtype=item.properties.dtype)
            elif isinstance(item, BytesStorageMetadata):
                state_dict[key] = None
        super().set_up_planner(state_dict, metadata, is_coordinator)


def read_full_state_dict(ckpt_dir: Path) -> dict[str, Any]:
    """Every tensor and value of a durable checkpoint, unsharded, keyed by DCP's flattened names."""
    load_dcp_metadata(Path(ckpt_dir))  # refuse unsafe metadata with our one-line error, not DCP's wrapper
    planner = _SafeEmptyStateDictLoadPlanner(flatten_state_dict=False)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({}, storage_reader=SafeFileSystemReader(ckpt_dir), planner=planner, no_dist=True)
    except BaseException as exc:
        raise _dcp_load_failure(exc, ckpt_dir, distributed=False) from None
    return planner.state_dict


def _dcp_load_failure(exc: BaseException, ckpt_dir: Path, *, distributed: bool) -> BaseException:
    """What to raise for ``exc``, raised by a DCP load of ``ckpt_dir``. DCP gathers every rank's failure
    into one ``CheckpointException`` that all ranks raise alike: it becomes the first failing rank's
    error (a ``CheckpointError`` naming the file), raised by every rank of a ``distributed`` load (rank 0
    reports it in one line; the others stay quiet). Anything else (an interrupt, a failure outside DCP's
    collectives) is raised as it was."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    rank = min(failures)
    failure = failures[rank]
    error = failure[0] if isinstance(failure, tuple) else failure
    if not isinstance(error, CheckpointError):
        error = CheckpointError(f"cannot load {ckpt_dir}: {describe_error(error)}")
    if not distributed:
        return error
    kind = UnsafeCheckpointError if isinstance(error, UnsafeCheckpointError) else CheckpointError
    return raised_by_every_rank(kind(f"{error} (rank {rank})"))
