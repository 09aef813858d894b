"""How the floors above join a ``CheckpointManager`` without the checkpoint tiers importing them.

The mirror to object storage (``trainguard.backup``) attaches itself with
``trainguard.backup.attach_mirror(manager, config)``: it is told of every commit through the manager's
commit hooks, holds back retention of the steps it is still copying, drops the steps a rollback
abandons, and is drained by ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

CommitHook = Callable[[int, Path], None]
"""Called on rank 0 with the step and path of each checkpoint once it is committed (after retention)."""

ResumeSource = Callable[[str, Path], str]
"""Turns a resume mode naming a copy kept elsewhere (a mirror URL) into a local one, restoring the copy
into the checkpoints root first (rank 0); any other mode is returned as it is."""


class CheckpointMirror(Protocol):
    def submit(self, step: int, path: Path) -> None: ...

    def pending_steps(self) -> set[int]:
        """Steps retention must keep for now (still waiting for their copy)."""
        ...

    def abandon_after(self, step: int) -> None: ...

    def close(self) -> None: ...
