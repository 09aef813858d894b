"""Checkpoints that are not ``global_step_N/`` directories of a checkpoints root: a checkpoint directory
named directly (a step, or one role of it: ``global_step_N/actor``), and the frozen roles of a multi-role
run (``checkpoints/ref/``, saved once, covered by no step's manifest). See checkpoint/roles.py."""

from __future__ import annotations

from pathlib import Path

from trainguard.checkpoint.discovery import CheckpointInfo
from trainguard.fs.layout import MANIFEST_NAME, is_transient_name, parse_step_dir
from trainguard.checkpoint.manifest import ManifestError, read_manifest


def checkpoint_dir(directory: Path) -> CheckpointInfo | None:
    """``directory`` as one checkpoint when it holds a manifest (else None: a run or checkpoints root)."""
    if not directory.is_dir() or (parse_step_dir(directory.name) is None and not (directory / MANIFEST_NAME).is_file()):
        return None
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        step = parse_step_dir(directory.name) or 0
        return CheckpointInfo(step, directory, committed=False, manifest=None, error=f"{MANIFEST_NAME}: {exc.reason}")
    return CheckpointInfo(manifest.step, directory, committed=True, manifest=manifest)


def frozen_role_dirs(root: Path) -> list[CheckpointInfo]:
    """The committed frozen-role folders directly under a checkpoints root (their manifest names the role)."""
    found = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or is_transient_name(entry.name) or parse_step_dir(entry.name) is not None:
            continue
        if not (entry / MANIFEST_NAME).is_file():
            continue
        info = checkpoint_dir(entry)
        if info is not None and (info.manifest is None or "role" in info.manifest.extra):
            found.append(info)
    return found
