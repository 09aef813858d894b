"""Which checkpoint a run resumes from: ``auto``, an explicit path, or ``disable``.

``auto`` takes the newest checkpoint that is committed, verifies and is healthy. Unhealthy ones
(marked in their manifest or in ``health_ckpts.json``) are always passed over: the public
implementation this follows records health but never excludes anything at resume.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainguard.checkpoint.discovery import CheckpointInfo, find_resume_checkpoint, list_checkpoints, repair_latest
from trainguard.fs.layout import HEALTH_FILE
from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError, ConfigError, NoCheckpointError
from trainguard.guards.health import NO_HEALTHY_CHECKPOINT_MESSAGE, marked_unhealthy, unhealthy_names


def check_explicit_resume_path(path: Path) -> None:
    """An explicit ``--resume PATH`` must be a committed trainguard checkpoint (exit 2 otherwise)."""
    if not path.is_dir():
        raise ConfigError(f"--resume {path}: no such checkpoint directory")
    try:
        read_manifest(path)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {path}: not a trainguard checkpoint ({exc})") from None


def health_rejection(root: Path, warn: Callable[[str], None]) -> Callable[[CheckpointInfo], str | None]:
    recorded_unhealthy = unhealthy_names(root / HEALTH_FILE, warn)

    def reject(info: CheckpointInfo) -> str | None:
        health = info.manifest.health if info.manifest else None
        if marked_unhealthy(health) or info.name in recorded_unhealthy:
            detail = ""
            if health and "embedding_local_norm" in health:
                detail = f": embedding local norm {health['embedding_local_norm']} > {health.get('threshold')}"
            return f"unhealthy{detail}"
        return None

    return reject


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
        if marked_unhealthy(read_manifest(path).health):
            warn(f"resuming from {path} as asked, although it is marked unhealthy")
        return path
    if not root.is_dir():
        return None
    unhealthy = health_rejection(root, warn)
    rejected_unhealthy: list[str] = []

    def combined(info: CheckpointInfo) -> str | None:
        reason = unhealthy(info)
        if reason:
            rejected_unhealthy.append(info.name)
            return reason
        return accept(info) if accept is not None else None

    chosen = find_resume_checkpoint(root, accept=combined, warn=warn)
    if chosen is not None:
        repair_latest(root, chosen.step, warn)
        return chosen.path
    committed = [info for info in list_checkpoints(root) if info.committed]
    if committed and len(rejected_unhealthy) == len(committed):
        raise NoCheckpointError(f"{root}: {NO_HEALTHY_CHECKPOINT_MESSAGE}")
    if committed:
        raise NoCheckpointError(
            f"no usable checkpoint in {root}: every committed checkpoint failed verification or was rejected "
            "(see the warnings above); pass --resume disable to start from scratch"
        )
    return None
