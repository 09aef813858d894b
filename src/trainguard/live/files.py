"""The names of a live run's files under its run directory."""

from __future__ import annotations

from pathlib import Path


def events_path(run_dir: Path) -> Path:
    return run_dir / "events.jsonl"


def checkpoint_path(run_dir: Path, step: int, shard: int) -> Path:
    """One shard's state file (parameters and that shard's optimizer state) that the restart-based
    recovery resumes from; every replica of the shard holds the same."""
    return run_dir / "checkpoints" / f"step_{step}" / f"shard{shard}.pt"


def newest_checkpoint(run_dir: Path, steps: int, shards: int) -> int | None:
    """The newest step whose every shard file is written (each is written atomically, one by one)."""
    return next((step for step in range(steps, 0, -1)
                 if all(checkpoint_path(run_dir, step, shard).exists() for shard in range(shards))), None)


def final_path(run_dir: Path, rank: int) -> Path:
    """Each rank's parameters and optimizer state at the end: compared bitwise across runs."""
    return run_dir / "final" / f"rank{rank}.pt"

