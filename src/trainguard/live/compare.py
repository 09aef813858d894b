"""Bitwise comparison of final states (parameters and optimizer state): two states, two runs rank by
rank, the replicas of each shard within a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.live.files import final_path
from trainguard.live.shards import shard_of, whole_state


def bitwise_differences(a: Any, b: Any, where: str = "") -> list[str]:
    """The paths at which two nested states differ in any bit (NaNs and signed zeros included)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [where or "."]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ"]
        return [d for key in a for d in bitwise_differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in bitwise_differences(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def run_differences(reference: Path, run: Path, world: int) -> dict[int, list[str]]:
    """Each rank's final state in ``run`` against the same rank's in ``reference`` (the same layout):
    the ranks that differ, with where."""
    return _differing(run, {rank: final_path(reference, rank) for rank in range(world)})


def replica_differences(run: Path, world: int, group_size: int) -> dict[int, list[str]]:
    """Each rank's final state against replica group 0's rank of the same shard: the replicas of a shard
    hold the same parameters and optimizer state bit for bit."""
    return _differing(run, {rank: final_path(run, shard_of(rank, group_size)) for rank in range(group_size, world)})


def _differing(run: Path, references: dict[int, Path]) -> dict[int, list[str]]:
    """Rank -> where its final state in ``run`` differs from the state file it is compared with."""
    found = {rank: bitwise_differences(safe_torch_load(final_path(run, rank)), safe_torch_load(reference))
             for rank, reference in references.items()}
    return {rank: where for rank, where in found.items() if where}


def whole_final_state(run: Path, group_size: int) -> dict:
    """Replica group 0's final state put together from its shards: comparable across layouts."""
    return whole_state([safe_torch_load(final_path(run, shard)) for shard in range(group_size)])
