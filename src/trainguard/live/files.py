"""The names of a live run's files under its run directory."""

from __future__ import annotations

import io
from pathlib import Path

import torch


def events_path(run_dir: Path) -> Path:
    return run_dir / "events.jsonl"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """The whole-state file the restart-based recovery resumes from (every rank holds the same state)."""
    return run_dir / "checkpoints" / f"step_{step}.pt"


def final_path(run_dir: Path, rank: int) -> Path:
    """Each rank's parameters and optimizer state at the end: compared bitwise across runs."""
    return run_dir / "final" / f"rank{rank}.pt"


def state_bytes(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
