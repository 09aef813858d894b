"""Offline repair of local checkpoints: finds missing or corrupt per-rank files by checksum and copies
each from a healthy member of its replica group, then re-verifies.

Input is a directory holding one or more local directories (each with its ``group_info.json``), e.g.
a run directory (``RUN/local/node*/``), ``RUN/local`` or one node's directory. Ranks whose directory
is gone entirely are repaired into the directory ``group_info.json`` recorded for them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.layout import parse_step_dir, step_dir_name
from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, parse_rank_file
from trainguard.checkpoint.local.plan import StepPlan, Transfer, plan_step
from trainguard.checkpoint.local.rank_manifest import read_rank_manifest
from trainguard.checkpoint.local.reader import StepHoldings, rank_holdings
from trainguard.checkpoint.local.writer import commit_rank_manifest, uncommit, write_file_durably
from trainguard.checkpoint.manifest import FileEntry
from trainguard.errors import CheckpointError, ConfigError
from trainguard.topology.group_info import GROUP_INFO_NAME, GroupInfo, read_group_info

_COPY_CHUNK = 8 << 20
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
    rank_dirs = {rank: Path(d) for rank, d in first.rank_dirs.items()}
    for path, info in infos:
        for rank in info.ranks:
            rank_dirs[rank] = path.parent  # where it is now wins over where the run wrote it
    missing = [r for r in range(first.groups.world_size) if r not in rank_dirs]
    if missing:
        raise ConfigError(f"{first_path}: no directory recorded for ranks {missing}")
    local = LocalSet(first, rank_dirs)
    _check_files(local)
    return local


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


def holdings_of(local: LocalSet, step: int) -> dict[int, dict[int, StepHoldings]]:
    return {rank: rank_holdings(directory, local.world_size, rank, [step])
            for rank, directory in local.rank_dirs.items()}


def _copy(src: Path, dst: Path, progress: Callable[[int], None] | None) -> FileEntry:
    def write(stream) -> None:
        with open(src, "rb", buffering=0) as f:
            buffer = bytearray(_COPY_CHUNK)
            view = memoryview(buffer)
            while count := f.readinto(buffer):
                stream.write(view[:count])
                if progress is not None:
                    progress(count)

    dst.parent.mkdir(parents=True, exist_ok=True)
    return write_file_durably(dst, write)


def repair_step(local: LocalSet, step: int, progress: Callable[[int], None] | None = None) -> StepResult:
    """Copies what the step's plan says (if every rank is recoverable), re-commits each repaired
    rank's manifest and re-verifies; ``result.plan.lost`` names what could not be restored."""
    holdings = holdings_of(local, step)
    plan = plan_step(step, local.info.groups, holdings)
    result = StepResult(step, plan)
    if not plan.recoverable or not plan.transfers:
        result.verified = plan.recoverable
        return result
    name = step_dir_name(step)
    receivers = sorted({t.dst for t in plan.transfers})
    for rank in receivers:
        step_dir = local.rank_dirs[rank] / name
        step_dir.mkdir(parents=True, exist_ok=True)
        uncommit(step_dir, local.world_size, rank)
    entries: dict[int, dict[str, FileEntry]] = {}
    for rank in receivers:
        held = holdings[rank].get(step, StepHoldings())
        entries[rank] = {e.path: e for e in list(held.own.values()) + list(held.replica_extras.values())}
    for transfer in plan.transfers:
        src = local.rank_dirs[transfer.src] / name / transfer.src_path
        dst = local.rank_dirs[transfer.dst] / name / transfer.dst_path
        copied = _copy(src, dst, progress)
        if copied.checksum != transfer.entry.checksum or copied.size != transfer.entry.size:
            raise CheckpointError(f"{src}: changed while it was copied (checksum differs from its manifest)")
        entries[transfer.dst][transfer.dst_path] = FileEntry(transfer.dst_path, copied.size, copied.checksum)
        result.actions.append(Action(step, transfer, src, dst))
    for rank in receivers:
        step_dir = local.rank_dirs[rank] / name
        config = step_dir / FSDP_CONFIG_NAME
        if not config.exists():
            donor = next(local.rank_dirs[t.src] / name / FSDP_CONFIG_NAME for t in plan.transfers if t.dst == rank)
            shutil.copyfile(donor, config)
        commit_rank_manifest(step_dir, step, rank=rank, world_size=local.world_size,
                             entries=sorted(entries[rank].values(), key=lambda e: e.path))
    # Re-verified: every byte was hashed on its way into the new file (checked against the source's
    # manifest above) and fsynced; the sizes on disk are checked here. Reading the files back would only
    # re-read the same pages from the cache, not the medium.
    result.verified = all(a.dst_file.stat().st_size == a.transfer.entry.size for a in result.actions)
    return result


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
