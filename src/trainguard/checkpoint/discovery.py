"""Finding checkpoints under a checkpoints root, and the one to resume from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainguard.fs.bounded import read_regular_bytes
from trainguard.fs.fsio import PathLike, atomic_write_text, remove_directory_crash_safe
from trainguard.fs.layout import LATEST_FILE, MANIFEST_NAME, STEP_DIR_PREFIX, parse_step_dir, parse_temp_dir
from trainguard.checkpoint.manifest import Manifest, ManifestError, read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError

INCOMPLETE = "incomplete (being written or abandoned)"
_MAX_TRACKER_BYTES = 64

@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed: bool
    manifest: Manifest | None
    error: str | None = None
    """Why the directory is not a committed checkpoint, naming the file at fault when there is one."""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def being_written(self) -> bool:
        """A ``global_step_N.tmp-*`` directory: not a checkpoint at all (yet, or ever)."""
        return parse_temp_dir(self.name) is not None


def checkpoints_root(path: PathLike) -> Path:
    """The checkpoints root of a run directory (its ``checkpoints/``), or ``path`` itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    nested = path / "checkpoints"
    return nested if nested.is_dir() else path


def list_checkpoints(root: PathLike) -> list[CheckpointInfo]:
    """Every checkpoint directory and unfinished one under ``root``, by step; nothing is verified."""
    found = []
    for entry in Path(root).iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        step = parse_step_dir(entry.name)
        if step is not None:
            found.append(_committed_or_broken(step, entry))
            continue
        step = parse_temp_dir(entry.name)
        if step is not None:
            found.append(CheckpointInfo(step, entry, committed=False, manifest=None, error=INCOMPLETE))
    return sorted(found, key=lambda info: (info.step, info.name))


def newest_committed(root: PathLike) -> CheckpointInfo | None:
    """The newest committed durable checkpoint under ``root`` (None without one or without ``root``):
    where a run stands, read without loading anything."""
    if not Path(root).is_dir():
        return None
    return max((info for info in list_checkpoints(root) if info.committed), key=lambda info: info.step, default=None)


def newest_committed_step(root: PathLike) -> int | None:
    """The step of :func:`newest_committed`."""
    newest = newest_committed(root)
    return newest.step if newest is not None else None


def _committed_or_broken(step: int, path: Path) -> CheckpointInfo:
    try:
        manifest = read_manifest(path)
    except ManifestError as exc:
        return CheckpointInfo(step, path, committed=False, manifest=None, error=f"{MANIFEST_NAME}: {exc.reason}")
    if manifest.step != step:
        # A copied or renamed directory: resuming from it would restore the wrong step.
        error = f"{MANIFEST_NAME}: records step {manifest.step}, not {step}"
        return CheckpointInfo(step, path, committed=False, manifest=None, error=error)
    return CheckpointInfo(step, path, committed=True, manifest=manifest)


def find_resume_checkpoint(
    root: PathLike,
    *,
    accept: Callable[[CheckpointInfo], str | None] | None = None,
    warn: Callable[[str], None],
) -> CheckpointInfo | None:
    """The newest committed checkpoint that verifies and that ``accept`` (returning a reason to reject,
    or None) does not reject; every newer checkpoint passed over is reported through ``warn``."""
    for info in reversed(list_checkpoints(root)):
        if info.being_written:
            continue
        if not info.committed:
            warn(f"skipping checkpoint {info.path}: {info.error}")
            continue
        # Asked before verifying, which reads every byte of the checkpoint.
        rejection = accept(info) if accept is not None else None
        if rejection:
            warn(f"skipping checkpoint {info.path}: {rejection}")
            continue
        bad = verify_checkpoint(info.path, info.manifest)
        if bad:
            more = f" (and {len(bad) - 1} more bad files)" if len(bad) > 1 else ""
            warn(f"skipping checkpoint {info.path}: {bad[0].path}: {bad[0].reason}{more}")
            continue
        return info
    return None


def read_latest(root: PathLike) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt``, None when there is no such file; a tracker
    that is not a regular file holding a bare step number is a ``CheckpointError`` naming it."""
    path = Path(root) / LATEST_FILE
    try:
        data = read_regular_bytes(path, _MAX_TRACKER_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}, expected a file holding a bare step number") from None
    text = data.decode("ascii", errors="replace")
    if parse_step_dir(f"{STEP_DIR_PREFIX}{text.strip()}") is None:
        raise CheckpointError(f"{path}: expected a bare step number, found {text[:40]!r}")
    return int(text.strip())


def latest_fault(root: PathLike, committed_steps: set[int]) -> str | None:
    """Why the tracker is wrong: unreadable, not a bare step number, or naming no committed checkpoint."""
    try:
        step = read_latest(root)
    except CheckpointError as exc:
        return str(exc)
    if step is not None and step not in committed_steps:
        return f"{Path(root) / LATEST_FILE}: names step {step}, which is not a committed checkpoint"
    return None


def write_latest(root: PathLike, step: int, *, sync_dir: bool = True) -> None:
    """Records ``step`` as the newest committed checkpoint; call only after it is committed. A directory
    in the tracker's place is removed first (a link or file is simply replaced). ``sync_dir=False``: the
    caller fsyncs ``root``, which may then make the tracker durable before the checkpoint's own rename
    (``latest_fault`` finds such a tracker and resuming repairs it)."""
    path = Path(root) / LATEST_FILE
    if path.is_dir() and not path.is_symlink():
        remove_directory_crash_safe(path)
    atomic_write_text(path, f"{step}\n", sync_dir=sync_dir)


def repair_latest(root: PathLike, step: int, warn: Callable[[str], None]) -> None:
    """Rewrites a tracker that is wrong (see ``latest_fault``) to ``step``, the checkpoint resumed from."""
    committed = {info.step for info in list_checkpoints(root) if info.committed}
    fault = latest_fault(root, committed)
    if fault is not None:
        warn(f"{fault}; rewriting it to {step}")
        write_latest(root, step)
