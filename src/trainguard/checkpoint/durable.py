"""The durable tier: torch.distributed.checkpoint (DCP) saves with an atomic commit.

Protocol (what makes a crash at any instant harmless):
1. every rank writes into ``global_step_N.tmp-<run token>/``: its DCP shard, its extra state;
2. DCP's own finish step gathers all ranks' write results, so when rank 0's save future completes,
   every rank's bytes are on disk (DCP fsyncs each file);
3. rank 0 hashes every file into ``trainguard.json`` (fsynced), renames the directory to
   ``global_step_N`` and only then replaces ``latest_checkpointed_iteration.txt``;
4. retention deletes old checkpoints by renaming them out of the namespace first.
At most one save is in flight: a new save first waits for the previous commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainguard.checkpoint.discovery import write_latest
from trainguard.checkpoint.fsio import commit_directory, fsync_dir, fsync_file, remove_directory_crash_safe
from trainguard.checkpoint.layout import extra_state_name, parse_step_dir, step_dir_name, temp_dir_name
from trainguard.checkpoint.manifest import build_manifest, write_manifest
from trainguard.checkpoint.retention import select_for_deletion
from trainguard.checkpoint.safe_load import load_dcp_metadata, safe_torch_load
from trainguard.events import EventLog


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
        self._inflight: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: int | None = None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_state: dict[str, Any],
        trainer_state: dict[str, Any],
        write_static_files: Callable[[Path], None],
    ) -> float:
        """Stages the state and starts writing it; returns the seconds the caller was blocked."""
        self.wait()
        started = time.perf_counter()
        tmp = self.root / temp_dir_name(step, self.run_token)
        tmp.mkdir(parents=True, exist_ok=True)
        extra_path = tmp / extra_state_name(self.world_size, self.rank)
        torch.save(extra_state, extra_path)
        fsync_file(extra_path)
        if self.rank == 0:
            write_static_files(tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        writer = FileSystemWriter(tmp, sync_files=True)
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.process_group)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.process_group)
            future = Future()
            future.set_result(None)
        blocked = time.perf_counter() - started
        if self.async_save:
            self._inflight = threading.Thread(
                target=self._finish_guarded, args=(future, step, tmp, trainer_state, started), daemon=True
            )
            self._inflight.start()
        else:
            self._finish(future, step, tmp, trainer_state, started)
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
            self._finish(*args)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc

    def _finish(self, future: Future, step: int, tmp: Path, trainer_state: dict, started: float) -> None:
        future.result()
        if self.rank != 0:
            return
        _fsync_tree(tmp)
        manifest = build_manifest(
            tmp,
            step=step,
            world_size=self.world_size,
            mesh_shape=self.mesh_shape,
            mesh_dim_names=self.mesh_dim_names,
            trainer_state=trainer_state,
        )
        write_manifest(tmp, manifest)
        final = self.root / step_dir_name(step)
        if final.exists():
            # left by a timeline this run resumed before (passed over as bad, or newer than the resume
            # point): the step is being redone, and the new one is the checkpoint of record
            remove_directory_crash_safe(final)
            self.events.emit("checkpoint_deleted", step=step, reason="replaced by a redone step", tier="durable")
        commit_directory(tmp, final)
        write_latest(self.root, step)
        self.last_committed = step
        size = sum(entry.size for entry in manifest.files)
        self.events.emit(
            "checkpoint_committed",
            step=step,
            path=str(final),
            bytes=size,
            seconds=time.perf_counter() - started,
            tier="durable",
        )
        self._apply_retention()
        if self.after_commit is not None:
            self.after_commit(step, final)

    def _apply_retention(self) -> None:
        steps = sorted(s for s in (parse_step_dir(p.name) for p in self.root.iterdir()) if s is not None)
        for step in select_for_deletion(steps, self.keep_last, self.keep_every):
            remove_directory_crash_safe(self.root / step_dir_name(step))
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="durable")

    def load(
        self, ckpt_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, source_world_size: int
    ) -> dict[str, Any]:
        """Loads model and optimizer (resharding as needed) and returns this rank's extra state.

        After a change of world size the per-rank extra state has no owner; rank 0's copy still holds
        the global facts (step, data position, LR schedule).
        """
        load_dcp_metadata(Path(ckpt_dir))  # refuse unsafe metadata with our one-line error, not DCP's wrapper
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(ckpt_dir),
            planner=SafeLoadPlanner(),
            process_group=self.process_group,
        )
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if source_world_size == self.world_size:
            return safe_torch_load(Path(ckpt_dir) / extra_state_name(self.world_size, self.rank))
        return safe_torch_load(Path(ckpt_dir) / extra_state_name(source_world_size, 0))


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
