"""A sharded tensor as pieces (blocks of the global tensor, each read from one place) and its assembly."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.errors import CheckpointError


@dataclass(frozen=True)
class Piece:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    """Returns the block as a tensor of shape ``sizes``."""
    where: str
    """The file (or file and record) the block comes from, for error messages."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class ShardedTensor:
    key: str
    """DCP-style name: ``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ..."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def check_coverage(self) -> None:
        """Pieces must tile the tensor exactly: inside it, and together exactly its element count
        (blocks from the placement math never overlap, so a shortfall means a missing shard)."""
        for piece in self.pieces:
            if len(piece.sizes) != len(self.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(piece.offsets, piece.sizes, self.shape)
            ):
                raise CheckpointError(f"{self.key}: block at {piece.offsets} of size {piece.sizes} from "
                                      f"{piece.where} lies outside the tensor's shape {list(self.shape)}")
        covered = sum(piece.numel for piece in self.pieces)
        if covered != math.prod(self.shape):
            raise CheckpointError(f"{self.key}: the shards cover {covered} of {math.prod(self.shape)} elements "
                                  f"of shape {list(self.shape)} (a shard is missing or the layout is wrong)")


def read_piece(tensor: ShardedTensor, piece: Piece) -> torch.Tensor:
    block = piece.read()
    if tuple(block.shape) != piece.sizes:
        raise CheckpointError(f"{tensor.key}: {piece.where} holds a block of shape {list(block.shape)}, "
                              f"expected {list(piece.sizes)} for global shape {list(tensor.shape)}")
    return block


def assemble(tensor: ShardedTensor, pool: Executor | None = None) -> torch.Tensor:
    """The full tensor, its pieces read in parallel on ``pool`` and copied into place (never concatenated)."""
    if len(tensor.pieces) == 1 and tensor.pieces[0].sizes == tensor.shape:
        return read_piece(tensor, tensor.pieces[0]).to(tensor.dtype).clone()
    full = torch.empty(tensor.shape, dtype=tensor.dtype)

    def place(piece: Piece) -> None:
        block = read_piece(tensor, piece)
        index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
        full[index].copy_(block)

    if pool is None:
        for piece in tensor.pieces:
            place(piece)
    else:
        for future in [pool.submit(place, piece) for piece in tensor.pieces]:
            future.result()
    return full


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, each tensor as pieces and each other value as is."""

    tensors: dict[str, ShardedTensor]
    objects: dict[str, Any]
    description: str
    world_size: int
    mesh_shape: list[int]
    mesh_dim_names: list[str]
