"""A save that fails because its file system is full: said in one line naming the directory, what the
checkpoint needs and what is free, instead of the writer's traceback."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from trainguard.errors import CheckpointError

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, its causes, or the per-rank failures DCP collects into one exception, hold a
    "no space left" (or quota exceeded) error."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL:
            return True
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            pending += [failure for failure in failures.values() if isinstance(failure, BaseException)]
        pending += [arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException)]
    return False


def disk_full_error(directory: Path, step: int, needed_bytes: int | None) -> CheckpointError:
    try:
        free = f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    need = f"needs about {needed_bytes:,} bytes" if needed_bytes else "needs more space"
    return CheckpointError(
        f"{directory}: file system full: the checkpoint of step {step} {need}, {free}; "
        "free space (or lower checkpoint.keep_last) and resume"
    )
