"""The durable tier: torch.distributed.checkpoint (DCP) saves with an atomic commit.

Protocol (what makes a crash at any instant harmless):
1. every rank writes into ``global_step_N.tmp-<run token>/``: its DCP shard and its extra state,
   hashing each file as it writes it (no file is read back) and fsyncing it;
2. DCP's own finish step gathers all ranks' write results (rank 0 then writes ``.metadata``); each
   rank then sends its files' checksums to rank 0 over the checkpoint's own process group, so once
   rank 0 has them all, every rank's files are on disk;
3. rank 0 hashes the files it wrote itself (``.metadata``, static files), writes ``trainguard.json``
   (fsynced), renames the directory to ``global_step_N`` and only then replaces
   ``latest_checkpointed_iteration.txt``;
4. retention deletes old checkpoints by renaming them out of the namespace first.
At most one save is in flight: a new save first waits for the previous commit. An async save copies
the state into staging buffers reused from save to save (``ReusableStager``), so it blocks only for
that copy; writing, gathering and committing run in one background thread, the only user of the
checkpoint's own process group.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM
from trainguard.checkpoint.discovery import list_checkpoints, write_latest
from trainguard.checkpoint.disk_full import disk_full_error, is_disk_full, tensor_bytes
from trainguard.fs.fsio import (
    SYNC_FILE_RANGE_WRITE,
    commit_directory,
    fsync_dir,
    fsync_file,
    remove_directory_crash_safe,
    sync_file_range,
)
from trainguard.fs.layout import (
    HEALTH_FILE,
    extra_state_name,
    parse_step_dir,
    step_dir_name,
    temp_dir_name,
)
from trainguard.checkpoint.manifest import FileEntry, build_manifest, read_manifest, write_manifest
from trainguard.checkpoint.retention import retention_after_commit
from trainguard.checkpoint.safe_load import load_dcp_metadata, safe_torch_load
from trainguard.checkpoint.staging import ReusableStager
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.guards.health import marked_unhealthy, record_health, unhealthy_names


# Optimizer state keyed by parameter name ("param_groups.<fqn>.lr"), never by group index: pipeline
# stages hold different parameters, and index-keyed groups of different stages would collide.
_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _marked_unhealthy(ckpt_dir: Path) -> bool:
    try:
        health = read_manifest(ckpt_dir).health
    except CheckpointError:
        return True  # unreadable: not a checkpoint worth protecting
    return marked_unhealthy(health)


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, except that ``.metadata`` is unpickled with an allow-list, never plainly."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = load_dcp_metadata(Path(self.path) / ".metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# ------------------------------------------------------------------------------------------ save side
# Large writes are handed to the kernel and hashed in pieces of this size, and the kernel is asked to
# start writing back every _WRITEBACK_CHUNK as soon as it is complete, so the disk works while later
# bytes are serialized instead of all at the closing fsync.
_PIECE = 4 << 20
_WRITEBACK_CHUNK = 16 << 20
# Smaller writes (zip headers and pickles of torch.save records, serialized objects: thousands per
# shard) are gathered into one buffer and written together, one system call per _COALESCE bytes.
_SMALL_WRITE = 64 << 10
_COALESCE = 1 << 20


def _checksum_of(digest: Any) -> str:
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


class _HashingFile:
    """A new file, written sequentially: every byte is hashed on its way to the disk (xxh3_64, the
    manifest's checksum), and ``close_durably`` fsyncs it and returns its size and checksum."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._position = 0
        self._written_back = 0
        self._digest = xxhash.xxh3_64()
        self._pending = bytearray()  # small writes not yet handed to the kernel (already hashed)
        self._hasher: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total = view.nbytes
        if total < _SMALL_WRITE:
            self._digest.update(view)
            self._pending += view
            self._position += total
            if len(self._pending) >= _COALESCE:
                self._flush_pending()
            return total
        self._flush_pending()
        # Hashed on a second thread while this one copies the same bytes into the page cache (both
        # release the GIL); waited for before returning, so the caller's buffer outlives the hashing
        # and the digest sees every write in file order.
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-hash")
        hashed = self._hasher.submit(self._hash_pieces, view)
        try:
            for start in range(0, total, _PIECE):
                self._write_out(view[start : start + _PIECE])
        finally:
            hashed.result()
        self._position += total
        self._start_writeback()
        return total

    def _hash_pieces(self, view: memoryview) -> None:
        for start in range(0, view.nbytes, _PIECE):
            self._digest.update(view[start : start + _PIECE])

    def _write_out(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def _flush_pending(self) -> None:
        if self._pending:
            with memoryview(self._pending) as pending:
                self._write_out(pending)
            self._pending = bytearray()

    def _start_writeback(self) -> None:
        if sync_file_range is not None and self._position - self._written_back >= _WRITEBACK_CHUNK:
            # asynchronous: starts writeback of what is complete; durability still comes from fsync
            pending = self._position - self._written_back
            sync_file_range(self._fd, self._written_back, pending, SYNC_FILE_RANGE_WRITE)
            self._written_back = self._position

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._flush_pending()

    def fileno(self) -> int:
        self._flush_pending()
        return self._fd

    def close_durably(self) -> tuple[int, str]:
        self._flush_pending()
        os.fsync(self._fd)
        self.close()
        return self._position, _checksum_of(self._digest)

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _fast_tensor_save_available() -> bool:
    save = getattr(torch.serialization, "_save", None)
    if save is None or not hasattr(torch.serialization, "_get_storage_alignment"):
        return False
    params = list(inspect.signature(save).parameters)
    return params == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


_FAST_TENSOR_SAVE = _fast_tensor_save_available()


def _save_tensor(tensor: torch.Tensor, stream: _HashingFile) -> None:
    """``torch.save(tensor, stream)``, byte for byte, except that the zip records carry no CRC32.

    DCP's reader loads each record with ``torch.load``, which does not check CRC32s; computing them
    costs more than the rest of the serialization (``torch.save`` of tensors to a file runs at about
    1.6 GB/s with them and 2.8 GB/s without on the benchmark machine), and the manifest's xxh3
    checksums already guard every byte. ``torch.serialization.set_crc32_options`` would do the same process-wide (also for the
    training thread's own ``torch.save`` calls); this writer is per call. Falls back to ``torch.save``
    where the private API differs.
    """
    if not _FAST_TENSOR_SAVE:
        torch.save(tensor, stream)
        return
    writer = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


class ChecksummingFileSystemWriter(FileSystemWriter):
    """DCP's file system writer, writing each rank's items to its one file ``__<rank>_0.distcp`` in
    the layout ``FileSystemReader`` reads (a ``torch.save`` record per tensor, raw bytes per object),
    hashing the bytes as they are written and fsyncing the file.

    After ``dcp.save`` returns, ``written`` maps each file this rank wrote to its manifest entry.
    Planning and the ``.metadata`` file are DCP's own (``finish`` is inherited).
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.written: dict[str, FileEntry] = {}

    def write_data(self, plan, planner):
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        # Objects first, then tensors in plan order: what DCP's own writer does with one thread.
        items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
        items += [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        results = []
        stream = _HashingFile(Path(self.path) / name)
        try:
            for item in items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()  # a view: save its bytes, not its whole storage
                    _save_tensor(tensor, stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            size, checksum = stream.close_durably()
        finally:
            stream.close()
        self.written[name] = FileEntry(name, size, checksum)
        future = torch.futures.Future()
        future.set_result(results)
        return future


def _plain(value: Any) -> bool:
    if type(value) is tuple:
        return all(_plain(item) for item in value)
    return value is None or type(value) in (bool, int, float, complex, str, bytes)


class _SerializeOnceSavePlanner(DefaultSavePlanner):
    """DCP's planner, except that equal non-tensor values are ``torch.save``d once per save.

    The flattened optimizer state holds each hyperparameter once per parameter (``lr``, ``betas``,
    ``eps``, flags...: hundreds of values, few distinct ones); ``torch.save`` of each took longer than
    the rest of planning. Only plain values (numbers, strings, None and tuples of them) are shared:
    two are equal when they pickle to the same bytes (so 1, 1.0 and True stay apart), and
    ``torch.save`` of equal plain values gives equal bytes, so the shard is byte for byte what DCP's
    planner would give.
    """

    def __init__(self) -> None:
        super().__init__()
        self._serialized: dict[bytes, bytes] = {}

    def transform_object(self, write_item, object: Any):
        if write_item.type != WriteItemType.BYTE_IO or not _plain(object):
            return super().transform_object(write_item, object)
        key = pickle.dumps(object, protocol=torch.serialization.DEFAULT_PROTOCOL)
        serialized = self._serialized.get(key)
        if serialized is None:
            serialized = self._serialized[key] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(serialized)


@dataclass
class _SaveJob:
    step: int
    tmp: Path
    trainer_state: dict[str, Any]
    started: float
    extra_path: Path
    extra_state: bytes
    health: dict[str, Any] | None = None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


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
        after_commit: Callable[[int, Path], None] | None = None,
        protected: Callable[[], set[int]] | None = None,
    ):
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
        self.after_commit = after_commit
        self.protected = protected  # steps retention must keep for now (e.g. waiting for their mirror upload)
        self._inflight: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager: ReusableStager | None = None
        self.last_committed: int | None = None

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
    ) -> float:
        """Stages the state and starts writing it; returns the seconds the caller was blocked.

        ``health`` (``{"is_health": 0|1, ...}``, 1 = unhealthy), when given, goes into the manifest
        and, once committed, into ``health_ckpts.json`` (rank 0).
        """
        self.wait()
        started = time.perf_counter()
        tmp = self.root / temp_dir_name(step, self.run_token)
        tmp.mkdir(parents=True, exist_ok=True)
        # Serialized now: the caller may change the objects it came from as soon as save() returns.
        extra = io.BytesIO()
        torch.save(extra_state, extra)
        job = _SaveJob(step, tmp, trainer_state, started, tmp / extra_state_name(self.world_size, self.rank),
                       extra.getvalue(), health)
        if self.rank == 0:
            write_static_files(tmp)
        if optimizer.state:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_STATE_DICT_OPTIONS)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            # No optimizer step yet (a step-0 save, or only skipped steps): there is no optimizer state,
            # and get_state_dict would invent one (a zero-gradient step: Adam's step count becomes 1).
            state = {"model": get_model_state_dict(model, options=_STATE_DICT_OPTIONS)}
        if self.async_save:
            if self._stager is None:
                self._stager = ReusableStager()
            # The previous save's write is over (wait() above), so its buffers may be overwritten.
            state = self._stager.stage(state)
            blocked = time.perf_counter() - started
            self._inflight = threading.Thread(target=self._finish_guarded, args=(state, job), daemon=True)
            self._inflight.start()
        else:
            self._finish_or_say_full(state, job)
            blocked = time.perf_counter() - started
        if self.rank == 0:
            self.events.emit("checkpoint_saved", step=step, blocked_s=blocked, async_save=self.async_save)
        return blocked

    def wait(self) -> None:
        """Blocks until the in-flight save is committed; re-raises its failure."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _finish_guarded(self, *args: Any) -> None:
        try:
            self._finish_or_say_full(*args)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc

    def _finish_or_say_full(self, state: dict[str, Any], job: _SaveJob) -> None:
        try:
            self._finish(state, job)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if not is_disk_full(exc):
                raise
            previous = [info for info in list_checkpoints(self.root) if info.committed]
            # the previous checkpoint's size, else this rank's share of tensors times the ranks
            needed = previous[-1].manifest.total_size if previous and previous[-1].manifest else \
                tensor_bytes(state) * self.world_size
            raise disk_full_error(self.root, job.step, needed) from None

    def _write_files(self, state: dict[str, Any], job: _SaveJob) -> tuple[dict[str, FileEntry], BaseException | None]:
        """Writes this rank's files; returns their manifest entries and a local failure, if any.

        The extra state is fsynced after DCP's save: an fsync while the big shards are being written
        back waits for the file system journal, and so for them. A failure to write the extra state
        does not skip DCP's save, whose collectives every rank must enter; DCP itself raises on every
        rank alike when any rank's write fails.
        """
        entries: dict[str, FileEntry] = {}
        failure: BaseException | None = None
        extra: _HashingFile | None = None
        try:
            try:
                extra = _HashingFile(job.extra_path)
                extra.write(job.extra_state)
            except Exception as exc:
                failure = exc
            writer = ChecksummingFileSystemWriter(job.tmp)
            dcp.save(state, storage_writer=writer, planner=_SerializeOnceSavePlanner(),
                     process_group=self.process_group)
            entries.update(writer.written)
            if failure is None and extra is not None:
                try:
                    size, checksum = extra.close_durably()
                    entries[job.extra_path.name] = FileEntry(job.extra_path.name, size, checksum)
                except Exception as exc:
                    failure = exc
        finally:
            if extra is not None:
                extra.close()
        return entries, failure

    def _gather_entries(
        self, job: _SaveJob, entries: dict[str, FileEntry], failure: BaseException | None
    ) -> dict[str, FileEntry]:
        """Every rank's entries on rank 0 (an empty dict elsewhere), over the checkpoint's own group;
        raises on every rank if any rank failed to write its files."""
        mine = (f"rank {self.rank}: {failure!r}" if failure is not None else None,
                [(e.path, e.size, e.checksum) for e in entries.values()])
        if self.process_group is None or not dist.is_initialized() or self.world_size == 1:
            # Without a group of its own (CheckpointManager always makes one), rank 0 hashes the other
            # ranks' files itself rather than use a group the training thread may be using.
            parts = [mine]
        else:
            parts = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0, group=self.process_group)
        if failure is not None:
            raise failure
        if self.rank != 0:
            return {}
        errors = [error for error, _ in parts if error is not None]
        if errors:
            raise CheckpointError(f"{job.tmp}: checkpoint of step {job.step} not saved: " + "; ".join(errors))
        known: dict[str, FileEntry] = {}
        for _, part in parts:
            for path, size, checksum in part:
                known[path] = FileEntry(path, size, checksum)
        return known

    def _finish(self, state: dict[str, Any], job: _SaveJob) -> None:
        entries, failure = self._write_files(state, job)
        known = self._gather_entries(job, entries, failure)
        if self.rank != 0:
            return
        step, tmp = job.step, job.tmp
        manifest = build_manifest(
            tmp,
            step=step,
            world_size=self.world_size,
            mesh_shape=self.mesh_shape,
            mesh_dim_names=self.mesh_dim_names,
            trainer_state=job.trainer_state,
            health=job.health,
            known=known,
        )
        # What rank 0 hashed itself (.metadata, static files) was read, not written, here: make sure it
        # is on disk before the manifest vouches for it (DCP fsynced .metadata; static files may not be).
        for entry in manifest.files:
            if entry.path not in known:
                fsync_file(tmp / entry.path)
        _fsync_tree(tmp)
        write_manifest(tmp, manifest)
        final = self.root / step_dir_name(step)
        if final.exists():
            # left by a timeline this run resumed before (passed over as bad, or newer than the resume
            # point): the step is being redone, and the new one is the checkpoint of record
            remove_directory_crash_safe(final)
            self.events.emit("checkpoint_deleted", step=step, reason="replaced by a redone step", tier="durable")
        commit_directory(tmp, final)
        if job.health is not None:
            record_health(self.root / HEALTH_FILE, final.name, marked_unhealthy(job.health))
        write_latest(self.root, step)
        self.last_committed = step
        size = sum(entry.size for entry in manifest.files)
        self.events.emit(
            "checkpoint_committed",
            step=step,
            path=str(final),
            bytes=size,
            seconds=time.perf_counter() - job.started,
            tier="durable",
        )
        self._apply_retention(step)
        if self.after_commit is not None:
            self.after_commit(step, final)

    def _apply_retention(self, committed: int) -> None:
        steps = [s for s in (parse_step_dir(p.name) for p in self.root.iterdir()) if s is not None]
        recorded = unhealthy_names(self.root / HEALTH_FILE)
        unhealthy = [s for s in steps if s <= committed and (step_dir_name(s) in recorded
                                                             or _marked_unhealthy(self.root / step_dir_name(s)))]
        keep = self.protected() if self.protected is not None else set()
        for step in retention_after_commit(steps, committed, unhealthy, self.keep_last, self.keep_every):
            if step in keep:
                continue
            remove_directory_crash_safe(self.root / step_dir_name(step))
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="durable")

    def load(
        self, ckpt_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, source_world_size: int
    ) -> dict[str, Any]:
        """Loads model and optimizer (resharding as needed) and returns this rank's extra state.

        After a change of world size the per-rank extra state has no owner; rank 0's copy still holds
        the global facts (step, data position, LR schedule).
        """
        metadata = load_dcp_metadata(Path(ckpt_dir))  # refuse unsafe metadata with our one-line error, not DCP's
        if has_optimizer_state(metadata):
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_STATE_DICT_OPTIONS)
            state = {"model": model_sd, "optim": optim_sd}
        else:  # saved before any optimizer step: the optimizer starts fresh, as it did then
            state = {"model": get_model_state_dict(model, options=_STATE_DICT_OPTIONS)}
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(ckpt_dir),
            planner=SafeLoadPlanner(),
            process_group=self.process_group,
        )
        if "optim" in state:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=_STATE_DICT_OPTIONS)
        else:
            set_model_state_dict(model, state["model"], options=_STATE_DICT_OPTIONS)
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
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    load_dcp_metadata(Path(ckpt_dir))  # refuse unsafe metadata with our one-line error, not DCP's wrapper
    planner = _SafeEmptyStateDictLoadPlanner(flatten_state_dict=False)
    _load_state_dict({}, storage_reader=SafeFileSystemReader(ckpt_dir), planner=planner, no_dist=True)
    return planner.state_dict
