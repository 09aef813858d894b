"""Reading small control files (manifests, trackers, health records) that may be hostile: only a
regular file, never through a link or from a FIFO, never more than a bound, and JSON without NaN,
Infinity or unbounded nesting."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from trainguard.errors import CheckpointError
from trainguard.fs.fsio import PathLike

MAX_JSON_DEPTH = 64
MAX_FORMAT_JSON_BYTES = 64 << 20
"""A rank manifest or group_info file lists a few files or ranks; this is thousands of times that."""


class BoundedReadError(OSError):
    """A control file that is not a regular file or is larger than its bound (the message says which)."""


def read_regular_bytes(path: PathLike, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``; a symlink, FIFO, device or
    directory is refused without being opened for reading (a FIFO would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symbolic link
            raise BoundedReadError(exc.errno, "a symbolic link, not a regular file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BoundedReadError(0, "not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise BoundedReadError(0, f"larger than {max_bytes} bytes")
    return data


def read_regular_text(path: PathLike, max_bytes: int) -> str:
    return read_regular_bytes(path, max_bytes).decode("utf-8")


def parse_json(text: str) -> Any:
    """``json.loads`` refusing nesting deeper than ``MAX_JSON_DEPTH``; raises ``ValueError`` with a
    one-line reason. NaN and Infinity are read as Python writes them: trainguard's own files carry a
    NaN loss or norm where a step had one, and fields that need a finite number check it themselves."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"not valid JSON (nested deeper than {MAX_JSON_DEPTH})")
    return data


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_format_json(path: PathLike, fmt: str, version: int, what: str, missing: str = "missing") -> dict:
    """A JSON file of one of trainguard's formats (``{"format": fmt, "version": version, ...}``), read as
    a control file (regular, bounded, never through a link); ``CheckpointError`` naming the file and the
    fault otherwise (``what`` names the kind of file)."""
    path = Path(path)
    try:
        data = parse_json(read_regular_text(path, MAX_FORMAT_JSON_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing}") from None
    except BoundedReadError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise CheckpointError(f"{path}: not a trainguard {what} (format should be {fmt!r})")
    if data.get("version") != version:
        raise CheckpointError(f"{path}: version {data.get('version')!r} is not supported (expected {version})")
    return data
