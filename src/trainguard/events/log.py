"""Append-only JSON-lines event log shared by every rank of a run.

Each event is written with a single ``write`` on a file opened with ``O_APPEND`` so lines from
different ranks never interleave.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class EventLog:
    """Writes events with ``time``, ``kind``, ``step``, ``rank`` and ``host`` to a JSONL file."""

    def __init__(self, path: str | os.PathLike | None, rank: int = 0, host: str | None = None):
        self.path = Path(path) if path is not None else None
        self.rank = rank
        self.host = host or socket.gethostname()
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, kind: str, step: int | None = None, **fields: Any) -> dict:
        event = {"time": time.time(), "kind": kind, "step": step, "rank": self.rank, "host": self.host}
        event.update(_jsonable(fields))
        if self._fd is not None:
            os.write(self._fd, (json.dumps(event, sort_keys=False) + "\n").encode())
        return event

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | os.PathLike, kind: str | None = None) -> Iterator[dict]:
    """Yields the events of a log, skipping a torn last line left by a crash."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or event.get("kind") == kind:
                yield event
