"""Command-line values shared by several commands, checked as argparse types or right after parsing."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from trainguard.errors import CheckpointError, ConfigError
from trainguard.fs.layout import LATEST_FILE


def make_run_dir(run_dir: str | Path) -> Path:
    """The run directory, absolute, created if missing; one ``ConfigError`` line when it cannot be a
    writable directory."""
    if not str(run_dir).strip():
        raise ConfigError("--run-dir '': an empty path; name a directory or leave the flag out")
    run_dir = Path(run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--run-dir {run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"--run-dir {run_dir}: not writable (read-only file system or no permission)")
    return run_dir


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds ≥ 0, got {text!r}")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}")
    return value


def resolve_root(directory: str) -> Path:
    # here, not at the top: the argparse types above serve parsers that must build without checkpoint code
    from trainguard.checkpoint.discovery import checkpoints_root, list_checkpoints

    try:
        root = checkpoints_root(directory)
    except CheckpointError as exc:
        raise ConfigError(f"{exc} (expected a run directory or its checkpoints/ directory)") from None
    # An arbitrary directory would list as empty; say instead that it is the wrong one.
    if root.name != "checkpoints" and not list_checkpoints(root) and not (root / LATEST_FILE).exists():
        raise ConfigError(
            f"{directory}: not a run directory or checkpoints root (no checkpoints/ or global_step_N/ in it)"
        )
    return root
