"""A save that fails because its file system is full: said in one line naming the directory, what the
checkpoint needs and what is free, instead of the writer's traceback."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from trainguard.errors import CheckpointError, raised_by_every_rank

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
        # Another rank's failure arrives as text (gathered by rank 0): "OSError(28, 'No space left...')".
        # (DCP's exception of all ranks quotes their tracebacks: "[Errno 28] No space left on device".)
        if any(marker in str(current) for code in _FULL for marker in (f"({code}, '{os.strerror(code)}", f"[Errno {code}]")):
            return True
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # rank -> exception, or (exception, traceback summary)
            for failure in failures.values():
                pending += [item for item in (failure if isinstance(failure, tuple) else (failure,))
                            if isinstance(item, BaseException)]
        pending += [arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException)]
    return False


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state dict (what a save of it writes, give or take headers)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def disk_full_error(directory: Path, step: int, needed_bytes: int | None) -> CheckpointError:
    try:
        free = f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    need = f"needs about {needed_bytes:,} bytes" if needed_bytes else "needs more space"
    return raised_by_every_rank(CheckpointError(
        f"{directory}: file system full: the checkpoint of step {step} {need}, {free}; "
        "free space (or lower checkpoint.keep_last) and resume"
    ))
