"""Checkpoint health from the embedding's local gradient norm, recorded in ``health_ckpts.json``.

The reference's rule: when a checkpoint is saved, the embedding local norm of every pipeline-stage-0
rank is compared with ``embedding_local_norm_threshold``; the checkpoint is unhealthy if any rank's
norm exceeds it. The trainer passes in the maximum over those ranks (already all-reduced), so one
comparison decides. The record file, one entry per checkpoint in save order, 1 = unhealthy::

    [
        {
            "is_health": 0,
            "ckpt_name": "global_step_8"
        }
    ]

Resume picks the newest checkpoint not recorded as unhealthy (a checkpoint asked for by name is loaded
whatever its health, as in the reference). Only one process (rank 0) writes the file.
"""

from __future__ import annotations

import enum
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.fs.bounded import parse_json, read_regular_text
from trainguard.fs.fsio import atomic_write_json
from trainguard.fs.layout import step_dir_name
from trainguard.errors import CheckpointError

log = logging.getLogger(__name__)
MAX_HEALTH_FILE_BYTES = 16 << 20

NO_HEALTHY_CHECKPOINT_MESSAGE = (
    "no healthy checkpoint to resume from: every checkpoint in health_ckpts.json is recorded as unhealthy "
    "(its embedding local norm exceeded guards.health.embedding_threshold / embedding_local_norm_threshold). "
    "Train from scratch until a healthy checkpoint is saved, or, if no run ever produces one, revisit "
    "embedding_local_norm_threshold (`trainguard guards calibrate RUN_DIR` recommends one from a clean run); "
    "to resume from a given checkpoint regardless of its health, name it explicitly"
)


@dataclass
class HealthConfig:
    enabled: bool = False
    embedding_threshold: float = 1.0  # embedding_local_norm_threshold (the reference's default)


class Health(enum.IntEnum):
    """A checkpoint's health verdict. The values are the reference's ``is_health`` (1 = unhealthy),
    the spelling used only where ``health_ckpts.json`` and manifests are written and read."""

    HEALTHY = 0
    UNHEALTHY = 1


def is_unhealthy(max_embedding_local_norm: float, threshold: float) -> bool:
    """True when the norm exceeds the threshold or is NaN/infinite (equal to the threshold is healthy)."""
    norm = float(max_embedding_local_norm)
    return not math.isfinite(norm) or norm > threshold


def judge_health(max_embedding_local_norm: float, threshold: float) -> Health:
    return Health.UNHEALTHY if is_unhealthy(max_embedding_local_norm, threshold) else Health.HEALTHY


def health_record(verdict: Health, max_embedding_local_norm: float, threshold: float) -> dict[str, Any]:
    """A manifest's ``health``: the verdict in the reference's spelling, with what it was judged on."""
    return {"is_health": int(verdict), "embedding_local_norm": max_embedding_local_norm, "threshold": threshold}


def save_health(config: HealthConfig, max_embedding_local_norm: float | None) -> dict[str, Any] | None:
    """The ``health`` a save records: the verdict on the norm of the step saved, with what it was judged
    on; None when health is not monitored or no step was measured since the start or a resume."""
    if not config.enabled or max_embedding_local_norm is None:
        return None
    verdict = judge_health(max_embedding_local_norm, config.embedding_threshold)
    return health_record(verdict, max_embedding_local_norm, config.embedding_threshold)


def health_of(record: Mapping[str, Any] | None) -> Health | None:
    """The verdict of a manifest's ``health`` or a ``health_ckpts.json`` record; None when there is none
    (health not monitored)."""
    value = record.get("is_health") if record else None
    return Health(value) if type(value) is int and value in (0, 1) else None


def marked_unhealthy(record: Mapping[str, Any] | None) -> bool:
    """Whether a recorded verdict (a manifest's ``health``, a ``health_ckpts.json`` record) is unhealthy:
    the one test of the reference's ``{"is_health": 1}``."""
    return health_of(record) is Health.UNHEALTHY


def _validate(path: Path, records: Any) -> list[dict]:
    expected = 'expected a JSON list of {"is_health": 0|1, "ckpt_name": "..."}'
    if not isinstance(records, list):
        raise CheckpointError(f"{path}: malformed health record file: {expected}, got {type(records).__name__}")
    for i, record in enumerate(records):
        ok = (
            isinstance(record, dict)
            and isinstance(record.get("ckpt_name"), str)
            and type(record.get("is_health")) is int
            and record["is_health"] in (0, 1)
        )
        if not ok:
            raise CheckpointError(f"{path}: malformed health record file: entry {i} is {record!r}; {expected}")
    return records


def read_health_records(path: str | os.PathLike) -> list[dict]:
    """The records in file order; ``[]`` when the file does not exist; CheckpointError naming the file
    when it is not a regular file, not valid JSON or not a list of records."""
    path = Path(path)
    try:
        text = read_regular_text(path, MAX_HEALTH_FILE_BYTES)
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read health record file: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        records = parse_json(text)
    except ValueError as exc:
        raise CheckpointError(f"{path}: malformed health record file: {exc}") from None
    return [{"is_health": r["is_health"], "ckpt_name": r["ckpt_name"]} for r in _validate(path, records)]


def record_health(path: str | os.PathLike, ckpt_name: str, unhealthy: bool, *, sync_dir: bool = True) -> None:
    """Adds (or replaces, in place) the record of ``ckpt_name`` and rewrites the file atomically
    (``sync_dir=False``: the caller fsyncs its directory)."""
    path = Path(path)
    verdict = Health.UNHEALTHY if unhealthy else Health.HEALTHY
    record = {"is_health": int(verdict), "ckpt_name": ckpt_name}
    records: list[dict] = []
    placed = False
    for old in read_health_records(path):
        if old["ckpt_name"] != ckpt_name:
            records.append(old)
        elif not placed:  # a duplicate left by another writer collapses into one record
            records.append(record)
            placed = True
    if not placed:
        records.append(record)
    atomic_write_json(path, records, indent=4, sync_dir=sync_dir)


def unhealthy_names(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> set[str]:
    """Names of the checkpoints recorded as unhealthy (for a name recorded twice, the last record wins).
    An unreadable file is a warning, not a stop: every manifest carries its checkpoint's health too."""
    latest = {r["ckpt_name"]: r for r in _readable_records(path, warn or log.warning)}
    return {name for name, record in latest.items() if marked_unhealthy(record)}


def _readable_records(path: str | os.PathLike, warn: Callable[[str], None]) -> list[dict]:
    try:
        return read_health_records(path)
    except CheckpointError as exc:
        warn(f"{exc}; health taken from the checkpoints' manifests only")
        return []


def latest_healthy_step(steps: Iterable[int], unhealthy: set[str]) -> int | None:
    """The newest of ``steps`` whose ``global_step_N`` name is not in ``unhealthy``; None if none is."""
    healthy = [step for step in steps if step_dir_name(step) not in unhealthy]
    return max(healthy) if healthy else None
