"""Writes one rank's local checkpoint of a step, with no communication, and prunes old ones.

Commit rule (per rank, the durable tier's rule applied to one rank's files): each file is written
under a temporary name, hashed as it is written, fsynced and renamed into ``global_step_N/``; the
rank's manifest is written last, atomically. A step is committed for a rank exactly while its
manifest exists. Re-saving a step first removes the rank's manifest, so a crash midway leaves the
rank's step uncommitted rather than mixed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM, file_checksum
from trainguard.checkpoint.hashing_file import HashingFile, save_tensor
from trainguard.fs.fsio import atomic_write_json, fsync_dir
from trainguard.fs.layout import HF_DIR, new_token, parse_step_dir, step_dir_name, TEMP_MARKER
from trainguard.checkpoint.local.paths import (
    FSDP_CONFIG_NAME,
    REPLICA_DIR,
    SPARE_DIR,
    parse_rank_file,
    rank_file_names,
    rank_manifest_name,
    replica_extra_name,
)
from trainguard.checkpoint.local.in_place import StagedFile, commit_staged
from trainguard.checkpoint.local.state import DTensorLayout, as_dtensors
from trainguard.checkpoint.local.rank_manifest import RankManifest, read_rank_manifest, write_rank_manifest
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.retention import select_for_deletion
from trainguard.errors import CheckpointError


@dataclass(frozen=True)
class SavedStep:
    step: int
    bytes: int
    seconds: float
    layout_moved: bool = False
    """A state file staged in place was written anew instead (``in_place.commit_staged``)."""


class BytesMismatch(CheckpointError):
    """The bytes written do not have the size and checksum they were expected to have."""


def write_file_durably(path: Path, write, expected: FileEntry | None = None, spare: Path | None = None) -> FileEntry:
    """Writes ``path`` via a temporary sibling, hashing on the way; returns its entry (name relative
    to the step directory is filled in by the caller). With ``expected``, bytes of another size or
    checksum (by ``expected``'s algorithm) never reach ``path``: the temporary file is removed and
    ``BytesMismatch`` raised. A ``spare`` file, when there is one, becomes the temporary file and is
    written over."""
    temp = path.with_name(f"{path.name}{TEMP_MARKER}{new_token()}")
    recycled = False
    if spare is not None:
        try:
            os.rename(spare, temp)
            recycled = True
        except FileNotFoundError:
            pass
    stream = HashingFile(temp, overwrite=recycled)
    try:
        write(stream)
        size, checksum = stream.close_durably()
        algorithm = expected.checksum.partition(":")[0] if expected is not None else CHECKSUM_ALGORITHM
        if algorithm != CHECKSUM_ALGORITHM:  # a memory-tier file's (``xxh3_64_pieces``), read back from node memory
            checksum = file_checksum(temp, algorithm)
        if expected is not None and (size, checksum) != (expected.size, expected.checksum):
            raise BytesMismatch(f"{path.name}: {size} bytes with checksum {checksum}, expected {expected.size} "
                                f"bytes with {expected.checksum}")
    except BaseException:
        stream.close()
        temp.unlink(missing_ok=True)
        raise
    os.replace(temp, path)
    return FileEntry(path.name, size, checksum)


def _bytes_writer(data: bytes):
    return lambda stream: stream.write(data)


def _object_writer(obj: Any):
    return lambda stream: save_tensor(obj, stream)


def uncommit(step_dir: Path, world_size: int, rank: int) -> None:
    manifest = step_dir / rank_manifest_name(world_size, rank)
    if manifest.exists():
        manifest.unlink()
        fsync_dir(step_dir)


def model_file_state(dtensor_layouts: dict[str, DTensorLayout] | None) -> Callable[[dict[str, Any]], Any]:
    """What a rank's model file holds, given its local tensors: with ``dtensor_layouts``, the local
    shards as the DTensors verl's tools read."""
    return (lambda state: as_dtensors(state, dtensor_layouts)) if dtensor_layouts else (lambda state: state)


def _write_new(path: Path, state: Any) -> FileEntry:
    return write_file_durably(path, _object_writer(state))


def save_rank_step(
    local_dir: Path, step: int, *, rank: int, world_size: int, model_state: dict[str, Any] | StagedFile,
    optim_state: dict[str, Any] | StagedFile, extra_state: bytes, replica_extras: dict[int, bytes],
    fsdp_config: dict[str, Any], recycle: bool = False, dtensor_layouts: dict[str, DTensorLayout] | None = None,
) -> SavedStep:
    """Writes and commits this rank's files for ``step``; ``replica_extras`` are other ranks' extra
    states this rank keeps a copy of. With ``recycle``, the state files are written over the spares
    a pruned step left (``remove_rank_step(keep_as_spares=True)``), where there are some; a state given
    as a ``StagedFile`` is that spare already, its tensors copied in place (``in_place``), and is
    completed and committed as it is. With ``dtensor_layouts``, the model's local shards are written as
    the DTensors verl's tools read (wrapped here, so that a writer process gets plain tensors through
    shared memory and the small layouts by pickle)."""
    started = time.perf_counter()
    step_dir = local_dir / step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    uncommit(step_dir, world_size, rank)
    names = rank_file_names(world_size, rank)
    moved = False

    def state_file(kind: str, state: dict[str, Any] | StagedFile, wrap: Callable[[dict[str, Any]], Any]) -> FileEntry:
        nonlocal moved
        if isinstance(state, StagedFile):
            entry, in_place = commit_staged(state, step_dir / names[kind], wrap, _write_new)
            moved = moved or not in_place
            return entry
        spare = local_dir / SPARE_DIR / names[kind] if recycle else None
        return write_file_durably(step_dir / names[kind], _object_writer(wrap(state)), spare=spare)

    entries = [
        state_file("model", model_state, model_file_state(dtensor_layouts)),
        state_file("optim", optim_state, lambda state: state),
        write_file_durably(step_dir / names["extra"], _bytes_writer(extra_state),
                           spare=local_dir / SPARE_DIR / names["extra"] if recycle else None),
    ]
    if replica_extras:
        (step_dir / REPLICA_DIR).mkdir(exist_ok=True)
        for owner, data in sorted(replica_extras.items()):
            relative = replica_extra_name(world_size, owner)
            entry = write_file_durably(step_dir / relative, _bytes_writer(data))
            entries.append(FileEntry(relative, entry.size, entry.checksum))
        fsync_dir(step_dir / REPLICA_DIR)
    # identical bytes from every rank (sorted keys): concurrent atomic replacements are harmless
    atomic_write_json(step_dir / FSDP_CONFIG_NAME, fsdp_config)
    config_entry = write_config_entry(step_dir)
    fsync_dir(step_dir)
    write_rank_manifest(step_dir, RankManifest(step, rank, world_size, tuple(entries) + (config_entry,)))
    fsync_dir(local_dir)
    return SavedStep(step, sum(e.size for e in entries), time.perf_counter() - started, moved)


def write_config_entry(step_dir: Path) -> FileEntry:
    path = step_dir / FSDP_CONFIG_NAME
    return FileEntry(FSDP_CONFIG_NAME, path.stat().st_size, file_checksum(path))


def own_files(step_dir: Path, world_size: int, rank: int) -> list[Path]:
    """This rank's files in a step directory: its state, manifest and the replica copies it holds."""
    found = [step_dir / name for name in rank_file_names(world_size, rank).values()]
    manifest = step_dir / rank_manifest_name(world_size, rank)
    if manifest.exists():
        try:
            found += [step_dir / e.path for e in read_rank_manifest(manifest).files if e.path.startswith(REPLICA_DIR)]
        except CheckpointError:
            pass  # an unreadable manifest: only the rank's own state files are known
    return found


def remove_rank_step(local_dir: Path, step: int, world_size: int, rank: int, *, keep_as_spares: bool = False) -> None:
    """Deletes this rank's files of ``step``, manifest first; the directory goes with the last rank.
    With ``keep_as_spares``, the rank's state files are kept, uncommitted, in ``SPARE_DIR``, for the
    next save to write over (``save_rank_step(recycle=True)``): in node memory, giving a new file its
    pages costs several times writing over pages it has (the memory tier)."""
    step_dir = local_dir / step_dir_name(step)
    if not step_dir.is_dir():
        return
    files = own_files(step_dir, world_size, rank)
    uncommit(step_dir, world_size, rank)
    kept = set(rank_file_names(world_size, rank).values()) if keep_as_spares else set()
    if kept:
        (local_dir / SPARE_DIR).mkdir(exist_ok=True)
    for path in files:
        if path.parent == step_dir and path.name in kept:
            try:
                os.replace(path, local_dir / SPARE_DIR / path.name)
            except FileNotFoundError:
                pass
        else:
            path.unlink(missing_ok=True)
    remove_if_abandoned(step_dir)


def remove_if_abandoned(step_dir: Path) -> None:
    """Removes a step directory that no rank's files are left in (a node-mate may race: fine)."""
    try:
        names = [p.name for p in step_dir.iterdir()]
        if any(parse_rank_file(n) for n in names):
            return
        for leftover in (step_dir / REPLICA_DIR, step_dir / FSDP_CONFIG_NAME):
            if leftover.is_dir():
                if not any(leftover.iterdir()):
                    leftover.rmdir()
                else:
                    return
            else:
                leftover.unlink(missing_ok=True)
        if (step_dir / HF_DIR).is_dir():  # the step's static files (config, tokenizer): no rank's state
            shutil.rmtree(step_dir / HF_DIR)
        step_dir.rmdir()
        fsync_dir(step_dir.parent)
    except OSError:
        pass


def rank_steps(local_dir: Path, world_size: int, rank: int) -> list[int]:
    """Steps with this rank's manifest present (committed, not verified), ascending."""
    if not local_dir.is_dir():
        return []
    steps = []
    for entry in local_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and (entry / rank_manifest_name(world_size, rank)).exists():
            steps.append(step)
    return sorted(steps)


def prune(local_dir: Path, world_size: int, rank: int, keep_last: int, recycle: bool = False) -> list[int]:
    """Deletes this rank's oldest local checkpoints beyond ``keep_last`` (with ``recycle``, keeping
    their state files as spares); returns their steps."""
    deleted = select_for_deletion(rank_steps(local_dir, world_size, rank), keep_last)
    for step in deleted:
        remove_rank_step(local_dir, step, world_size, rank, keep_as_spares=recycle)
    return deleted


def clean_rank_leftovers(local_dir: Path, world_size: int, rank: int) -> None:
    """Removes this rank's temporary files and its files of steps it never committed."""
    if not local_dir.is_dir():
        return
    for entry in local_dir.iterdir():
        if parse_step_dir(entry.name) is None or not entry.is_dir():
            continue
        for path in list(entry.iterdir()) + list((entry / REPLICA_DIR).glob("*")):
            if TEMP_MARKER in path.name and f"_rank_{rank}." in path.name.split(TEMP_MARKER)[0]:
                path.unlink(missing_ok=True)
        if not (entry / rank_manifest_name(world_size, rank)).exists():
            for path in rank_file_names(world_size, rank).values():
                (entry / path).unlink(missing_ok=True)
        remove_if_abandoned(entry)


def commit_rank_manifest(step_dir: Path, step: int, *, rank: int, world_size: int, entries: list[FileEntry]) -> None:
    """Writes the rank's manifest over ``entries`` plus ``fsdp_config.json`` (already in place)."""
    write_rank_manifest(step_dir, RankManifest(step, rank, world_size, tuple(entries) + (write_config_entry(step_dir),)))
