"""The durable tier's writer: DCP shards hashed as they are written, and every rank's file entries
gathered to rank 0 for the manifest.

``write_rank_files`` writes one rank's files of a save (its DCP shard through
``ChecksummingFileSystemWriter``, its extra-state file); ``gather_entries`` brings every rank's entries
to rank 0 over the checkpoint's own process group, raising on every rank when any rank failed. What
rank 0 then does with them is ``checkpoint.commit``.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from trainguard.checkpoint.collection_pause import collections_paused
from trainguard.checkpoint.hashing_file import write_records
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.writer_process import IN_PROCESS, Writer
from trainguard.errors import CheckpointError


class ChecksummingFileSystemWriter(FileSystemWriter):
    """DCP's file system writer, writing each rank's items to its one file ``__<rank>_0.distcp`` in
    the layout ``FileSystemReader`` reads (a ``torch.save`` record per tensor, raw bytes per object),
    hashing the bytes as they are written and fsyncing the file.

    After ``dcp.save`` returns, ``written`` maps each file this rank wrote to its manifest entry.
    Planning and the ``.metadata`` file are DCP's own (``finish`` is inherited).
    """

    def __init__(self, path: str | os.PathLike, files: Writer = IN_PROCESS, *, direct: bool = True):
        """``files`` runs the writing (``write_records``): here (the default), or in a writer process;
        ``direct``: whether the shard bypasses the page cache (``HashingFile``)."""
        # ``sync_files=False``: this writer fsyncs the shards itself (``write_records``), and DCP's own
        # fsync of ``.metadata`` (torch 2.13 ``FileSystemWriter.finish``) runs before its buffered bytes
        # are flushed, so it only cost a journal commit: the commit's seal fsyncs ``.metadata``.
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.files = files
        self.direct = direct
        self.written: dict[str, FileEntry] = {}

    def write_data(self, plan, planner):
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        # Objects first, then tensors in plan order: what DCP's own writer does with one thread.
        items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
        items += [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        records: list[Any] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                records.append(data.getvalue())
            else:
                tensor = data.detach()
                records.append(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        spans, size, checksum = self.files.run(write_records, Path(self.path) / name, records, direct=self.direct)
        results = [WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                   for item, (offset, length) in zip(items, spans)]
        self.written[name] = FileEntry(name, size, checksum)
        future = torch.futures.Future()
        future.set_result(results)
        return future


def _plain(value: Any) -> bool:
    if type(value) is tuple:
        return all(_plain(item) for item in value)
    return value is None or type(value) in (bool, int, float, complex, str, bytes)


class SerializeOnceSavePlanner(DefaultSavePlanner):
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
class SaveJob:
    """One rank's part of one save: where its files go and what it writes besides the DCP shard."""

    step: int
    tmp: Path
    trainer_state: dict[str, Any]
    started: float
    extra_path: Path
    extra_state: bytes
    health: dict[str, Any] | None = None


def write_rank_files(
    state: dict[str, Any], job: SaveJob, process_group: dist.ProcessGroup | None, files: Writer = IN_PROCESS,
    *, direct: bool = True,
) -> tuple[dict[str, FileEntry], BaseException | None]:
    """Writes this rank's files through ``files`` (here, or in a writer process); returns their
    manifest entries and a local failure, if any. ``direct``: whether they bypass the page cache.

    The extra state is written after DCP's save: an fsync while the big shards are being written
    back waits for the file system journal, and so for them. DCP itself raises on every rank alike
    when any rank's write fails (a writer process that died included). Automatic garbage collection is
    paused during DCP's save (``collection_pause``): its planning would otherwise set off full
    collections that stall the training thread.
    """
    writer = ChecksummingFileSystemWriter(job.tmp, files, direct=direct)
    with collections_paused():
        dcp.save(state, storage_writer=writer, planner=SerializeOnceSavePlanner(), process_group=process_group)
    entries = dict(writer.written)
    try:
        _, size, checksum = files.run(write_records, job.extra_path, [job.extra_state], direct=direct)
    except Exception as exc:
        return entries, exc
    entries[job.extra_path.name] = FileEntry(job.extra_path.name, size, checksum)
    return entries, None


def gather_entries(
    job: SaveJob,
    entries: dict[str, FileEntry],
    failure: BaseException | None,
    *,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
) -> dict[str, FileEntry]:
    """Every rank's entries on rank 0 (an empty dict elsewhere), over the checkpoint's own group;
    raises on every rank if any rank failed to write its files."""
    mine = (f"rank {rank}: {failure!r}" if failure is not None else None,
            [(e.path, e.size, e.checksum) for e in entries.values()])
    if process_group is None or not dist.is_initialized() or world_size == 1:
        # Without a group of its own (CheckpointManager always makes one), rank 0 hashes the other
        # ranks' files itself rather than use a group the training thread may be using.
        parts = [mine]
    else:
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=process_group)
    if failure is not None:
        raise failure
    if rank != 0:
        return {}
    errors = [error for error, _ in parts if error is not None]
    if errors:
        raise CheckpointError(f"{job.tmp}: checkpoint of step {job.step} not saved: " + "; ".join(errors))
    known: dict[str, FileEntry] = {}
    for _, part in parts:
        for path, size, checksum in part:
            known[path] = FileEntry(path, size, checksum)
    return known
