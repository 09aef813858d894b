"""Offline repair of local checkpoints: finds missing or corrupt per-rank files by checksum and copies
each from a healthy member of its replica group, then re-verifies.

Input is a directory holding one or more local directories (each with its ``group_info.json``), e.g.
a run directory (``RUN/local/node*/``), ``RUN/local`` or one node's directory. Ranks whose directory
is gone entirely are repaired into the directory ``group_info.json`` recorded for them, rebuilt whole:
its ``group_info.json``, the step's ``huggingface/`` and ``latest_checkpointed_iteration.txt`` too.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from trainguard.checkpoint.discovery import list_checkpoints, read_latest, write_latest
from trainguard.fs.fsio import atomic_write_json, fsync_dir, fsync_tree
from trainguard.fs.layout import HF_DIR, TEMP_MARKER, new_token, parse_step_dir, step_dir_name
from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, parse_rank_file, replica_extra_name
from trainguard.checkpoint.local.plan import StepPlan, Transfer, plan_step
from trainguard.checkpoint.local.rank_manifest import file_fault, read_rank_manifest
from trainguard.checkpoint.local.reader import StepHoldings, rank_holdings
from trainguard.checkpoint.local.writer import BytesMismatch, commit_rank_manifest, uncommit, write_file_durably
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.trusted import require_regular_entries
from trainguard.errors import CheckpointError, ConfigError
from trainguard.topology.group_info import GROUP_INFO_NAME, GroupInfo, read_group_info

_COPY_CHUNK = 1 << 20  # read, hashed and written while still in the CPU's cache
_COPY_BUFFERS = 3
_SEARCH_DEPTH = 3


@dataclass
class LocalSet:
    """Every rank's local directory of one run, with the replica groups."""

    info: GroupInfo
    rank_dirs: dict[int, Path]

    @property
    def world_size(self) -> int:
        return self.info.groups.world_size


@dataclass
class Action:
    step: int
    transfer: Transfer
    src_file: Path
    dst_file: Path


@dataclass
class StepResult:
    step: int
    plan: StepPlan
    actions: list[Action] = field(default_factory=list)
    verified: bool = False


def _group_info_files(directory: Path) -> list[Path]:
    found = []
    frontier = [directory]
    for _ in range(_SEARCH_DEPTH + 1):
        next_frontier = []
        for d in frontier:
            if (d / GROUP_INFO_NAME).is_file():
                found.append(d / GROUP_INFO_NAME)
                continue  # a local directory: its step directories hold no further ones
            try:
                next_frontier += sorted(p for p in d.iterdir() if p.is_dir() and parse_step_dir(p.name) is None)
            except OSError:
                pass
        frontier = next_frontier
    return sorted(found)


def discover(directory: str | Path) -> LocalSet:
    """The local directories under ``directory``; ``ConfigError`` (one line) for bad input."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory")
    files = _group_info_files(root)
    if not files:
        raise ConfigError(f"{root}: not a local checkpoint directory (no {GROUP_INFO_NAME} in it or below it)")
    infos = []
    for path in files:
        try:
            infos.append((path, read_group_info(path)))
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
    first_path, first = infos[0]
    for path, info in infos[1:]:
        if info.groups != first.groups:
            raise ConfigError(f"{path}: world size {info.groups.world_size} and replica groups differ from "
                              f"{first_path} (world size {first.groups.world_size}): not one run's checkpoints")
    rank_dirs = {rank: _moved_with(Path(d), infos) for rank, d in first.rank_dirs.items()}
    for path, info in infos:
        for rank in info.ranks:
            rank_dirs[rank] = path.parent  # where it is now wins over where the run wrote it
    missing = [r for r in range(first.groups.world_size) if r not in rank_dirs]
    if missing:
        raise ConfigError(f"{first_path}: no directory recorded for ranks {missing}")
    local = LocalSet(first, rank_dirs)
    _check_files(local)
    return local


def _moved_with(recorded: Path, infos: list[tuple[Path, GroupInfo]]) -> Path:
    """Where a rank's directory is, given where the run wrote it: beside the directories found, when
    those were moved or copied (``RUN/local/node1`` of a copied run is the copy's, never the original's)."""
    for path, info in infos:
        written = Path(info.rank_dirs[info.ranks[0]]) if info.ranks and info.ranks[0] in info.rank_dirs else None
        if written is None or written == path.parent:
            continue
        try:
            return path.parent.parent / recorded.relative_to(written.parent)
        except ValueError:
            continue
    return recorded


def _check_files(local: LocalSet) -> None:
    """Refuses files of another world size and manifests that do not parse (one line each)."""
    for directory in sorted(set(local.rank_dirs.values())):
        if not directory.is_dir():
            continue
        for step_dir in sorted(p for p in directory.iterdir() if p.is_dir() and parse_step_dir(p.name) is not None):
            for path in sorted(step_dir.iterdir()):
                parsed = parse_rank_file(path.name)
                if parsed is None:
                    continue
                kind, world_size, _ = parsed
                if world_size != local.world_size:
                    raise ConfigError(f"{path}: world size {world_size} in the name, but {GROUP_INFO_NAME} says "
                                      f"{local.world_size} (mixed world sizes)")
                if kind == "manifest":
                    try:
                        read_rank_manifest(path)
                    except CheckpointError as exc:
                        raise ConfigError(str(exc)) from None


def local_steps(local: LocalSet) -> list[int]:
    steps = set()
    for directory in set(local.rank_dirs.values()):
        if directory.is_dir():
            steps |= {s for s in (parse_step_dir(p.name) for p in directory.iterdir()) if s is not None}
    return sorted(steps)


@dataclass
class _Ledger:
    """One step's files as repair knows them: per rank, those its manifest lists that are present with
    the listed size. Each is hashed once, while a copy reads it or in the final sweep; one whose bytes
    do not match is dropped and the step planned again. So every source byte is read once, as ``cp``
    would, and corrupt files are still found."""

    world_size: int
    held: dict[int, StepHoldings]
    verified: set[tuple[int, str]] = field(default_factory=set)

    @classmethod
    def read(cls, local: LocalSet, step: int) -> _Ledger:
        held = {rank: rank_holdings(directory, local.world_size, rank, [step], hashed=False).get(step, StepHoldings())
                for rank, directory in local.rank_dirs.items()}
        return cls(local.world_size, held)

    def plan(self, step: int, groups) -> StepPlan:
        return plan_step(step, groups, {rank: {step: held} for rank, held in self.held.items()})

    def entries(self, rank: int) -> list[FileEntry]:
        held = self.held[rank]
        return sorted(list(held.own.values()) + list(held.replica_extras.values()), key=lambda e: e.path)

    def drop(self, rank: int, path: str) -> None:
        held = self.held[rank]
        held.own = {kind: e for kind, e in held.own.items() if e.path != path}
        held.replica_extras = {owner: e for owner, e in held.replica_extras.items() if e.path != path}

    def hold(self, rank: int, entry: FileEntry) -> None:
        """``rank`` now holds ``entry``'s file, written and hashed by the repair."""
        held = self.held[rank]
        kind, _, owner = parse_rank_file(PurePosixPath(entry.path).name)
        if entry.path == replica_extra_name(self.world_size, owner):
            held.replica_extras[owner] = entry
        else:
            held.own["extra" if kind == "extra_state" else kind] = entry
        self.verified.add((rank, entry.path))

    def sweep(self, step_dirs: dict[int, Path], progress: Callable[[int], None] | None) -> bool:
        """Hashes every file not yet verified; drops those that do not match. True when none was dropped."""
        intact = True
        for rank in sorted(self.held):
            for entry in self.entries(rank):
                if (rank, entry.path) in self.verified:
                    continue
                if file_fault(step_dirs[rank], entry) is None:
                    self.verified.add((rank, entry.path))
                else:
                    self.drop(rank, entry.path)
                    intact = False
                if progress is not None:
                    progress(entry.size)
        return intact


def _copy(src: Path, dst: Path, expected: FileEntry, progress: Callable[[int], None] | None) -> FileEntry:
    """Copies ``src`` to ``dst`` durably; ``BytesMismatch`` (and ``dst`` untouched) when the bytes read
    are not ``expected``'s. The next chunk is read while a writer thread hashes and writes the last
    (both release the GIL for most of their time): with two cores this outruns ``cp``."""
    def write(stream) -> None:
        buffers = [bytearray(_COPY_CHUNK) for _ in range(_COPY_BUFFERS)]
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="repair-write") as writer, open(src, "rb", buffering=0) as f:
            index = 0
            while count := f.readinto(buffers[index % _COPY_BUFFERS]):
                if len(pending) == _COPY_BUFFERS - 1:
                    pending.popleft().result()  # the buffer read next is free only once its write is done
                pending.append(writer.submit(stream.write, memoryview(buffers[index % _COPY_BUFFERS])[:count]))
                index += 1
                if progress is not None:
                    progress(count)
            while pending:
                pending.popleft().result()

    dst.parent.mkdir(parents=True, exist_ok=True)
    return write_file_durably(dst, write, expected)


def repair_step(local: LocalSet, step: int, progress: Callable[[int], None] | None = None) -> StepResult:
    """Copies what the step's plan says, re-commits each repaired rank's manifest and re-verifies;
    ``result.plan.lost`` names what could not be restored. A source found corrupt while it is copied,
    or a file found corrupt by the final sweep, is dropped and the step planned again."""
    name = step_dir_name(step)
    step_dirs = {rank: directory / name for rank, directory in local.rank_dirs.items()}
    ledger = _Ledger.read(local, step)
    actions: list[Action] = []
    receivers: set[int] = set()
    while True:
        plan = ledger.plan(step, local.info.groups)
        if not plan.recoverable:
            ledger.sweep(step_dirs, progress)  # so that the lost files named are all of them
            plan = ledger.plan(step, local.info.groups)
            break
        for transfer in plan.transfers:
            src = step_dirs[transfer.src] / transfer.src_path
            dst = step_dirs[transfer.dst] / transfer.dst_path
            if transfer.dst not in receivers:
                step_dirs[transfer.dst].mkdir(parents=True, exist_ok=True)
                uncommit(step_dirs[transfer.dst], local.world_size, transfer.dst)
                receivers.add(transfer.dst)
            try:
                copied = _copy(src, dst, transfer.entry, progress)
            except BytesMismatch:
                ledger.drop(transfer.src, transfer.src_path)
                break
            ledger.verified.add((transfer.src, transfer.src_path))
            ledger.hold(transfer.dst, FileEntry(transfer.dst_path, copied.size, copied.checksum))
            actions.append(Action(step, transfer, src, dst))
        else:
            if ledger.sweep(step_dirs, progress):
                break
    for rank in sorted(receivers):
        config = step_dirs[rank] / FSDP_CONFIG_NAME
        if not config.exists():
            donor = next(step_dirs[a.transfer.src] / FSDP_CONFIG_NAME for a in actions if a.transfer.dst == rank)
            shutil.copyfile(donor, config)
        commit_rank_manifest(step_dirs[rank], step, rank=rank, world_size=local.world_size,
                             entries=ledger.entries(rank))
    if plan.recoverable:
        for directory in sorted({local.rank_dirs[rank] for rank in receivers}):
            _restore_directory_files(local, directory, step)
    result = StepResult(step, plan, actions)
    # Re-verified: every byte was hashed on its way into the new file (checked against the source's
    # manifest before the rename) and fsynced; the sizes on disk are checked here. Reading the files
    # back would only re-read the same pages from the cache, not the medium.
    result.verified = plan.recoverable and all(a.dst_file.stat().st_size == a.transfer.entry.size for a in actions)
    return result


def _restore_directory_files(local: LocalSet, directory: Path, step: int) -> None:
    """What a wiped directory shares among its ranks besides their files: ``group_info.json`` (its
    ranks, every rank's directory), the step's ``huggingface/`` (copied from another directory's same
    step) and ``latest_checkpointed_iteration.txt`` (moved forward to ``step``)."""
    if not (directory / GROUP_INFO_NAME).is_file():
        ranks = tuple(r for r, d in sorted(local.rank_dirs.items()) if d == directory)
        info = GroupInfo(local.info.groups, local.info.layout, ranks,
                         {r: str(d) for r, d in sorted(local.rank_dirs.items())})
        atomic_write_json(directory / GROUP_INFO_NAME, info.to_dict())
    step_dir = directory / step_dir_name(step)
    if not (step_dir / HF_DIR).is_dir():
        donors = [d / step_dir_name(step) / HF_DIR for d in sorted(set(local.rank_dirs.values())) if d != directory]
        donor = next((d for d in donors if (d / "config.json").is_file()), None)
        if donor is not None:
            require_regular_entries(donor)  # never copied through a link
            temp = step_dir / f"{HF_DIR}{TEMP_MARKER}{new_token()}"
            shutil.copytree(donor, temp)
            fsync_tree(temp)
            os.replace(temp, step_dir / HF_DIR)
            fsync_dir(step_dir)
    try:
        stale = (read_latest(directory) or -1) < step
    except CheckpointError:
        stale = True
    if stale:
        write_latest(directory, step)


def newest_durable(local: LocalSet) -> Path | None:
    """The newest committed durable checkpoint of the run the local directories belong to (searched in
    ``checkpoints/`` of their ancestors)."""
    seen = set()
    for directory in local.rank_dirs.values():
        for parent in list(directory.parents)[:4]:
            root = parent / "checkpoints"
            if root in seen or not root.is_dir():
                continue
            seen.add(root)
            committed = [info for info in list_checkpoints(root) if info.committed]
            if committed:
                return max(committed, key=lambda info: info.step).path
    return None


def repair_rate(results: list[StepResult], seconds: float) -> tuple[int, int, float]:
    """(files, bytes, bytes per second) moved."""
    moved = [a.transfer.entry.size for r in results for a in r.actions]
    return len(moved), sum(moved), (sum(moved) / seconds if seconds > 0 else 0.0)
