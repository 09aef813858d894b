"""Which block of a global tensor one rank holds, from its DTensor placements (pure).

A mesh coordinate's block is found by chunking the global tensor the way DTensor does: each
``Shard(d)`` splits dim ``d`` like ``torch.chunk`` (FSDP2's uneven last shard, possibly empty), in
mesh order; ``Replicate()`` keeps it whole. ``_StridedShard(d, sf)`` is what FSDP2 puts on its mesh
dim when tensor parallel already shards the same dim: FSDP chunks each TP shard, so strided shards
apply after the plain ones. Every block is one contiguous range per dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trainguard.errors import CheckpointError

REPLICATE = "replicate"
SHARD = "shard"
STRIDED = "strided"

_SHARD = re.compile(r"(?:Shard|S)\((?:dim=)?(\d+)\)")
_STRIDED = re.compile(r"(?:_StridedShard|_S)\((?:dim=)?(\d+),\s*(?:sf=|split_factor=)?(\d+)\)")
_REPLICATE = re.compile(r"(?:Replicate|R)(?:\(\))?")


@dataclass(frozen=True)
class Placement:
    kind: str
    dim: int = -1
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind == REPLICATE:
            return "Replicate()"
        if self.kind == SHARD:
            return f"Shard({self.dim})"
        return f"_StridedShard({self.dim}, sf={self.split_factor})"


def parse_placement(text: str) -> Placement:
    """``"Replicate()"``, ``"Shard(0)"``/``"Shard(dim=0)"``, ``"_S(0, 2)"``/``"_StridedShard(dim=0, sf=2)"``."""
    text = text.strip()
    if match := _STRIDED.fullmatch(text):
        return Placement(STRIDED, int(match.group(1)), int(match.group(2)))
    if match := _SHARD.fullmatch(text):
        return Placement(SHARD, int(match.group(1)))
    if _REPLICATE.fullmatch(text):
        return Placement(REPLICATE)
    if text.startswith(("Partial", "P(")):
        raise CheckpointError(f"placement {text!r}: a partial (unreduced) tensor cannot be merged")
    raise CheckpointError(f"unknown placement {text!r}")


def placement_of(obj: Any) -> Placement:
    """A DTensor placement object (``Shard``, ``_StridedShard``, ``Replicate``) as a ``Placement``."""
    name = type(obj).__name__
    if name == "_StridedShard":
        return Placement(STRIDED, int(obj.dim), int(obj.split_factor))
    if name == "Shard":
        return Placement(SHARD, int(obj.dim))
    if name == "Replicate":
        return Placement(REPLICATE)
    raise CheckpointError(f"placement {obj!r}: cannot be merged (only Shard and Replicate can)")


def coordinate(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh coordinate of ``rank``: row-major, the last mesh dim contiguous (DeviceMesh's order)."""
    coords = []
    for size in reversed(mesh_shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def _chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` of a range: chunks of ceil(length/parts), the last ones short or empty."""
    size = -(-length // parts) if length else 0
    begin = min(index * size, length)
    return start + begin, max(0, min(size, length - begin))


def local_block(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, length) per tensor dim of the block the rank at ``coord`` holds."""
    if len(placements) != len(mesh_shape):
        raise CheckpointError(f"{len(placements)} placements for a {len(mesh_shape)}-D mesh")
    ranges = [(0, size) for size in global_shape]
    order = [i for i, p in enumerate(placements) if p.kind == SHARD]
    order += [i for i, p in enumerate(placements) if p.kind == STRIDED]
    for mesh_dim in order:
        dim = placements[mesh_dim].dim
        if not 0 <= dim < len(global_shape):
            raise CheckpointError(f"placement {placements[mesh_dim]} on a {len(global_shape)}-D tensor")
        start, length = ranges[dim]
        ranges[dim] = _chunk(start, length, mesh_shape[mesh_dim], coord[mesh_dim])
    return tuple(ranges)
