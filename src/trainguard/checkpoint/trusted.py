"""The gate in front of every tool that reads a checkpoint (merge, convert, test, backup): nothing is
read from a checkpoint that does not verify, and nothing through a link, FIFO or device inside it."""

from __future__ import annotations

from pathlib import Path

from trainguard.checkpoint.manifest import checkpoint_entries, read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError
from trainguard.fs.fsio import PathLike
from trainguard.fs.layout import MANIFEST_NAME

# A role (global_step_N/actor) or a model directory (global_step_N/huggingface) sits this deep at most.
_MANIFEST_SEARCH_DEPTH = 2


def require_verified(path: PathLike) -> Path:
    """Returns ``path`` once the checkpoint holding it verifies against its manifest (the directory's own
    or one up to two levels above that lists files under it); a directory no manifest covers must hold
    only regular files and directories. Raises ``CheckpointError`` naming the first bad entry."""
    path = Path(path)
    if not path.is_dir():
        return path  # the reader says what is missing
    covering = _covering_checkpoint(path)
    if covering is None:
        require_regular_entries(path)
        return path
    bad = verify_checkpoint(covering, read_manifest(covering))
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{covering / bad[0].path}: {bad[0].reason}{more}; refusing to read a checkpoint that does not verify "
            f"(trainguard ckpt verify {covering})"
        )
    return path


def require_regular_entries(path: PathLike) -> None:
    """Refuses a directory holding anything but regular files and directories (a link could lead outside)."""
    root = Path(path)
    for relative, kind in checkpoint_entries(root):
        if kind not in ("file", "directory"):
            raise CheckpointError(f"{root / relative}: not a regular file ({kind}); refusing to read it")


def _covering_checkpoint(path: Path) -> Path | None:
    resolved = path.resolve()
    for depth, candidate in enumerate((resolved, *resolved.parents)):
        if depth > _MANIFEST_SEARCH_DEPTH:
            return None
        if (candidate / MANIFEST_NAME).exists() or (candidate / MANIFEST_NAME).is_symlink():
            if depth == 0:
                return candidate
            prefix = resolved.relative_to(candidate).as_posix() + "/"
            try:
                listed = read_manifest(candidate).files
            except CheckpointError:
                return None
            return candidate if any(entry.path.startswith(prefix) for entry in listed) else None
    return None
