"""What /proc says of a process: alive (a zombie counts as ended) and its parent."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def parent_of(pid: int) -> int:
    return int(_stat_fields(pid)[1])
