"""Finding checkpoints under a checkpoints root, and the one to resume from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainguard.fs.fsio import PathLike, atomic_write_text
from trainguard.fs.layout import LATEST_FILE, MANIFEST_NAME, parse_step_dir, parse_temp_dir
from trainguard.checkpoint.manifest import Manifest, ManifestError, read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError

INCOMPLETE = "incomplete (being written or abandoned)"



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
        if not entry.is_dir():
            continue
        step = parse_step_dir(entry.name)
        if step is not None:
            found.append(_committed_or_broken(step, entry))
            continue
        step = parse_temp_dir(entry.name)
        if step is not None:
            found.append(CheckpointInfo(step, entry, committed=False, manifest=None, error=INCOMPLETE))
    return sorted(found, key=lambda info: (info.step, info.name))


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
    """The step in ``latest_checkpointed_iteration.txt``, None when there is no such file."""
    path = Path(root) / LATEST_FILE
    try:
        text = path.read_bytes().decode("ascii", errors="replace")
    except FileNotFoundError:
        return None
    stripped = text.strip()
    if not stripped.isdigit():
        raise CheckpointError(f"{path}: expected a bare step number, found {text[:40]!r}")
    return int(stripped)


def write_latest(root: PathLike, step: int) -> None:
    """Records ``step`` as the newest committed checkpoint; call only after it is committed."""
    atomic_write_text(Path(root) / LATEST_FILE, f"{step}\n")
