"""Names of everything under a run's ``checkpoints/`` root.

A committed checkpoint is ``global_step_N/``; while written it is ``global_step_N.tmp-<token>/`` and
while deleted ``.trash-global_step_N-<token>/``, so a crash at any instant never leaves a directory
that looks committed but is not.
"""

from __future__ import annotations

import re
import secrets

MANIFEST_NAME = "trainguard.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
HEALTH_FILE = "health_ckpts.json"
HF_DIR = "huggingface"
"""The model's config and tokenizer beside its weights (a checkpoint's, a local directory's, a merge's)."""

STEP_DIR_PREFIX = "global_step_"
TEMP_MARKER = ".tmp-"
TRASH_PREFIX = ".trash-"

# No leading zeros: exactly the names step_dir_name produces, so "global_step_08" is never a checkpoint.
_STEP = r"(0|[1-9][0-9]*)"
_STEP_DIR = re.compile(rf"{STEP_DIR_PREFIX}{_STEP}")
_TEMP_DIR = re.compile(rf"{STEP_DIR_PREFIX}{_STEP}{re.escape(TEMP_MARKER)}.+")


def new_token() -> str:
    """A short random token that keeps transient names of concurrent writers apart."""
    return secrets.token_hex(4)


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed checkpoint directory name, None for any other name."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def temp_dir_name(step: int, token: str | None = None) -> str:
    """Name of the directory a checkpoint is written into before it is committed.

    All ranks writing one checkpoint must agree on ``token`` (pass one rank 0 broadcast).
    """
    return f"{step_dir_name(step)}{TEMP_MARKER}{token or new_token()}"


def parse_temp_dir(name: str) -> int | None:
    """The step of a checkpoint still being written (or abandoned), None for any other name."""
    match = _TEMP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def trash_name(name: str, token: str | None = None) -> str:
    return f"{TRASH_PREFIX}{name}-{token or new_token()}"


def is_transient_name(name: str) -> bool:
    """True for leftovers of an interrupted write or delete, which are never checkpoints."""
    return name.startswith(TRASH_PREFIX) or TEMP_MARKER in name


def extra_state_name(world_size: int, rank: int) -> str:
    return f"extra_state_world_size_{world_size}_rank_{rank}.pt"


def model_shard_name(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


def optim_shard_name(world_size: int, rank: int) -> str:
    return f"optim_world_size_{world_size}_rank_{rank}.pt"
