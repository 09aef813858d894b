"""What a rank's local directory holds: per step, which of the rank's own files and which replica
copies it holds are intact (present, listed in its manifest, checksums matching)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainguard.fs.layout import step_dir_name
from trainguard.checkpoint.local.paths import rank_file_names, rank_manifest_name, replica_extra_name
from trainguard.checkpoint.local.rank_manifest import file_fault, read_rank_manifest
from trainguard.checkpoint.local.writer import rank_steps
from trainguard.checkpoint.manifest import FileEntry
from trainguard.errors import CheckpointError

KINDS = ("model", "optim", "extra")


@dataclass
class StepHoldings:
    """One rank's intact files of one step: its own kinds and the owners of the replica copies it holds,
    each with the manifest entry (the checksum a receiver checks the bytes against)."""

    own: dict[str, FileEntry] = field(default_factory=dict)
    replica_extras: dict[int, FileEntry] = field(default_factory=dict)


def rank_holdings(local_dir: Path, world_size: int, rank: int, steps: list[int] | None = None, *,
                  hashed: bool = True) -> dict[int, StepHoldings]:
    """``step -> StepHoldings`` for the rank's committed steps (or the given ones), every file hashed
    (with ``hashed=False``, files present with their manifest's size: candidates, to be hashed later)."""
    holdings: dict[int, StepHoldings] = {}
    for step in steps if steps is not None else rank_steps(local_dir, world_size, rank):
        step_dir = local_dir / step_dir_name(step)
        try:
            manifest = read_rank_manifest(step_dir / rank_manifest_name(world_size, rank))
        except CheckpointError:
            continue
        if manifest.step != step or manifest.rank != rank or manifest.world_size != world_size:
            continue
        held = StepHoldings()
        for kind, name in rank_file_names(world_size, rank).items():
            entry = manifest.entry(name)
            if entry is not None and file_fault(step_dir, entry, hashed=hashed) is None:
                held.own[kind] = entry
        for owner in range(world_size):
            entry = manifest.entry(replica_extra_name(world_size, owner))
            if entry is not None and file_fault(step_dir, entry, hashed=hashed) is None:
                held.replica_extras[owner] = entry
        holdings[step] = held
    return holdings
