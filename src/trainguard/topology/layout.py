"""The parallel layout: mesh degrees resolved against a world size (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.errors import ConfigError

# Mesh dimension order, outermost first: ranks of one tp group are contiguous (DeviceMesh row-major).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelConfig:
    """Degrees of the device mesh; a ``None`` degree is derived so the product equals the world size."""

    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    pp: int | None = None
    ranks_per_node: int | None = None  # ranks sharing a node (and its local directory); None = all of them


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        coords = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]


def resolve_layout(parallel: ParallelConfig, world_size: int) -> Layout:
    """Fills in the one missing degree (dp_shard first) so the product equals ``world_size``."""
    given = {name: getattr(parallel, name) for name in MESH_DIMS}
    missing = [name for name, degree in given.items() if degree is None]
    known = math.prod(degree for degree in given.values() if degree is not None)
    described = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None) or "no degrees"
    if world_size % known:
        raise ConfigError(f"impossible parallel layout: {described} does not divide {world_size} ranks")
    rest = world_size // known
    fill_order = ["dp_shard", "dp_replicate", "tp", "pp"]
    for name in fill_order:
        if name in missing:
            given[name] = rest
            rest = 1
    if rest != 1:
        raise ConfigError(
            f"impossible parallel layout: {described} uses {known} ranks, but {world_size} were started"
        )
    return Layout(**given)
