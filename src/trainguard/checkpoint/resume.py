"""Which checkpoint a run resumes from: ``auto``, an explicit path, or ``disable``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainguard.checkpoint.discovery import CheckpointInfo, find_resume_checkpoint, list_checkpoints
from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError, ConfigError, NoCheckpointError


def check_explicit_resume_path(path: Path) -> None:
    """An explicit ``--resume PATH`` must be a committed trainguard checkpoint (exit 2 otherwise)."""
    if not path.is_dir():
        raise ConfigError(f"--resume {path}: no such checkpoint directory")
    try:
        read_manifest(path)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {path}: not a trainguard checkpoint ({exc})") from None


def choose_resume_checkpoint(
    mode: str,
    root: Path,
    warn: Callable[[str], None],
    accept: Callable[[CheckpointInfo], str | None] | None = None,
) -> Path | None:
    if mode == "disable":
        return None
    if mode != "auto":
        path = Path(mode)
        check_explicit_resume_path(path)
        bad = verify_checkpoint(path)
        if bad:
            raise NoCheckpointError(f"--resume {path}: {path / bad[0].path}: {bad[0].reason}")
        return path
    if not root.is_dir():
        return None
    chosen = find_resume_checkpoint(root, accept=accept, warn=warn)
    if chosen is not None:
        return chosen.path
    if any(info.committed for info in list_checkpoints(root)):
        raise NoCheckpointError(
            f"no usable checkpoint in {root}: every committed checkpoint failed verification "
            "(see the warnings above); pass --resume disable to start from scratch"
        )
    return None
