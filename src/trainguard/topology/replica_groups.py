"""Replica groups: which ranks hold bit-identical model shards, and which identical optimizer shards.

Pure math over two rank orders (reference 001 lists the cases; each is covered here):

* ``DeviceMesh`` (FSDP2 / HSDP, torchtitan's order): a row-major mesh, last dim contiguous, over any
  of ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``. Parameters and their optimizer state are
  sharded over ``dp_shard`` and ``cp`` (FSDP shards over both), split by ``tp`` and ``pp``, and
  replicated over ``dp_replicate`` only: a replica group is the ranks that differ in their
  ``dp_replicate`` coordinate alone.
* Megatron's order ``tp-cp-ep-dp-pp`` (``tp`` fastest). Weights are split by ``tp``, ``ep`` (expert
  shards; dense weights replicated over ``ep`` are not counted as redundancy) and ``pp``, and
  replicated over the data-parallel domain ``dp × cp``. The optimizer state is sharded over that
  domain with ``optimizer_shard`` ranks per shard group (consecutive members of the domain, as
  Megatron's distributed-optimizer instances and MindSpore's ``optimizer_weight_shard_size`` do):
  ``1`` = off, every domain member holds the same optimizer state; ``< dp × cp`` = members at the same
  position of different shard groups hold the same optimizer shard; ``= dp × cp`` = no two ranks do.
  ``shard_weights=True`` gives MindSpore's optimizer parallelism, where the weights themselves are
  sliced like the optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEVICE_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MEGATRON_ORDER = "tp-cp-ep-dp-pp"
_MEGATRON_DIMS = ("tp", "cp", "ep", "dp", "pp")  # fastest-varying first


@dataclass(frozen=True)
class ReplicaGroups:
    """Two partitions of ``range(world_size)``; each group is sorted, groups sorted by first rank."""

    world_size: int
    model: tuple[tuple[int, ...], ...]
    optim: tuple[tuple[int, ...], ...]

    def model_replicas(self, rank: int) -> list[int]:
        """The ranks holding a bit-identical model shard to ``rank``'s, ``rank`` included."""
        return list(_group_of(self.model, rank, self.world_size))

    def optim_replicas(self, rank: int) -> list[int]:
        """The ranks holding an identical optimizer shard to ``rank``'s, ``rank`` included."""
        return list(_group_of(self.optim, rank, self.world_size))

    def full_replicas(self, rank: int) -> list[int]:
        """Ranks holding both the same model shard and the same optimizer shard as ``rank``."""
        optim = set(self.optim_replicas(rank))
        return [r for r in self.model_replicas(rank) if r in optim]


def _group_of(groups: tuple[tuple[int, ...], ...], rank: int, world_size: int) -> tuple[int, ...]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world size {world_size}")
    for group in groups:
        if rank in group:
            return group
    raise AssertionError("replica groups do not cover every rank")


def _check_degrees(degrees: Mapping[str, int]) -> None:
    for name, degree in degrees.items():
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ValueError(f"degree {name} must be an integer >= 1, got {degree!r}")


def _partition(world_size: int, key) -> tuple[tuple[int, ...], ...]:
    groups: dict[object, list[int]] = {}
    for rank in range(world_size):
        groups.setdefault(key(rank), []).append(rank)
    return tuple(sorted(tuple(group) for group in groups.values()))


def row_major_coordinates(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of ``rank`` in a row-major mesh of ``shape`` (last dim contiguous)."""
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def device_mesh_replica_groups(shape: Sequence[int], dim_names: Sequence[str]) -> ReplicaGroups:
    """Replica groups of an FSDP2/HSDP ``DeviceMesh`` with these dims (names from ``DEVICE_MESH_ORDER``,
    any order; absent dims have degree 1)."""
    if len(shape) != len(dim_names):
        raise ValueError(f"mesh shape {list(shape)} and dim names {list(dim_names)} differ in length")
    unknown = [name for name in dim_names if name not in DEVICE_MESH_ORDER]
    if unknown or len(set(dim_names)) != len(dim_names):
        raise ValueError(f"mesh dim names must be distinct names from {DEVICE_MESH_ORDER}, got {list(dim_names)}")
    _check_degrees(dict(zip(dim_names, shape)))
    world_size = math.prod(shape)
    replicate = list(dim_names).index("dp_replicate") if "dp_replicate" in dim_names else None

    def shard_key(rank: int) -> tuple[int, ...]:
        coords = row_major_coordinates(rank, shape)
        return tuple(c for i, c in enumerate(coords) if i != replicate)

    groups = _partition(world_size, shard_key)
    return ReplicaGroups(world_size, groups, groups)


def megatron_coordinates(rank: int, degrees: Mapping[str, int]) -> dict[str, int]:
    """Coordinates in Megatron's ``tp-cp-ep-dp-pp`` order (``tp`` fastest)."""
    coords = {}
    for name in _MEGATRON_DIMS:
        coords[name] = rank % degrees[name]
        rank //= degrees[name]
    return coords


def megatron_replica_groups(
    *, tp: int = 1, cp: int = 1, ep: int = 1, dp: int = 1, pp: int = 1,
    optimizer_shard: int = 1, shard_weights: bool = False,
) -> ReplicaGroups:
    """Replica groups of Megatron's ``tp-cp-ep-dp-pp`` order with an optimizer-shard degree."""
    degrees = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    _check_degrees({**degrees, "optimizer_shard": optimizer_shard})
    domain = dp * cp
    if domain % optimizer_shard:
        raise ValueError(f"optimizer_shard={optimizer_shard} must divide the data-parallel domain dp×cp={domain}")
    world_size = math.prod(degrees.values())

    def weight_key(rank: int) -> tuple[int, ...]:
        c = megatron_coordinates(rank, degrees)
        return (c["tp"], c["ep"], c["pp"])

    def optim_key(rank: int) -> tuple[int, ...]:
        c = megatron_coordinates(rank, degrees)
        position = c["dp"] * cp + c["cp"]  # the rank's index within its dp×cp domain (cp is faster)
        return weight_key(rank) + (position % optimizer_shard,)

    optim = _partition(world_size, optim_key)
    model = optim if shard_weights else _partition(world_size, weight_key)
    return ReplicaGroups(world_size, model, optim)
