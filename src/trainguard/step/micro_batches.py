"""``guard.step(loss_of)`` in the closure mode: this rank's micro-batches of the step's global batch.

The loop hands ``Guard.step`` the loss of one micro-batch by index, ``loss_of(model, step, micro_batch)``
(``step`` counts the steps committed before this one, from 0: the data position is the step), in both
modes. The global batch of a step is ``train.micro_batches`` micro-batches, ``M``. In the closure mode
data-parallel rank ``i`` of ``D`` computes micro-batches ``i, i + D, i + 2D, ...`` (the split live mode
makes over its quorum, ``live.ordered_sum.my_micro_batches``), so ``M`` must be a multiple of ``D``:
every rank runs as many backwards, and FSDP's collectives pair up. Each micro-batch's loss is scaled by
``D / M`` before its backward: the data-parallel wrapper (FSDP2, HSDP, DDP) averages the ranks'
gradients, which makes the step's gradient that of the mean loss over the ``M`` micro-batches, and the
mean of the ranks' returned losses (``Guard``'s one all-reduce) that mean loss. Each micro-batch's random
draws (dropout) are seeded from ``(train.seed, step, micro_batch)`` (``live.rng``), as in live mode: the
same micro-batch draws the same masks whichever rank computes it, and an SDC rerun draws them again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.errors import ConfigError, raised_by_every_rank
from trainguard.live.ordered_sum import my_micro_batches
from trainguard.live.rng import micro_batch_rng
from trainguard.live.micro_batch import MicroBatchLoss

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "dp")  # the mesh dims over which ranks see different data


def takes_no_arguments(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a closure of the earlier contract (called with nothing) rather than a
    micro-batch loss (called with the model, the step and the micro-batch)."""
    try:
        inspect.signature(function).bind()
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class DataParallelPlace:
    """This rank's index among the ranks that see different data, and their number."""
    index: int
    size: int

    @classmethod
    def of(cls, mesh: Any, rank: int, world_size: int) -> DataParallelPlace:
        """From the mesh's data-parallel dims (row-major over them, as the mesh orders ranks); without a
        mesh every rank is its own data-parallel rank."""
        if mesh is None:
            return cls(rank, world_size)
        names = list(mesh.mesh_dim_names or ())
        coordinate = mesh.get_coordinate()
        index, size = 0, 1
        for dim, name in enumerate(names):
            if name in DATA_PARALLEL_DIMS:
                index = index * mesh.shape[dim] + coordinate[dim]
                size *= mesh.shape[dim]
        return cls(index, size)


def micro_batch_closure(loss_of: MicroBatchLoss, model: torch.nn.Module, step: int, micro_batches: int,
                        place: DataParallelPlace, seed: int) -> Callable[[], torch.Tensor]:
    """The closure ``Guard.step`` runs (and reruns after an SDC detection) for ``loss_of``: the backward of
    this rank's micro-batches of step ``step`` (from 0), each scaled by ``D / M``; returns their scaled sum."""
    if micro_batches % place.size:
        raise raised_by_every_rank(ConfigError(
            f"config key 'train.micro_batches' is {micro_batches}, not a multiple of the {place.size} data-parallel "
            "ranks: guard.step(loss_of) gives every rank as many micro-batches of the global batch"))
    mine = my_micro_batches(micro_batches, place.size, place.index)

    def closure() -> torch.Tensor:
        total = None  # on the loss's device: no host sync per micro-batch
        for micro_batch in mine:
            with micro_batch_rng(seed, step, micro_batch):
                loss = loss_of(model, step, micro_batch) * place.size / micro_batches  # with D = 1, as live mode divides
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    return closure


def step_samples(sample_range: Callable[[int, int], tuple[int, int]], step: int,
                 micro_batches: int) -> list[tuple[int, int]]:
    """The sample ranges of the whole global batch of step ``step`` (from 0), for the ``step`` event."""
    return [sample_range(step, micro_batch) for micro_batch in range(micro_batches)]

