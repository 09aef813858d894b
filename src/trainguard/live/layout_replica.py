"""Whole replicas (``parallel.dp_shard`` 1): every rank holds all the parameters; a step's micro-batches are
dealt over the members and summed as one all-reduce of a row per micro-batch (``ordered_sum``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from trainguard.live.group_reduce import Exchange, StepSum
from trainguard.live.layout import EpochLink, LayoutKind
from trainguard.live.micro_batch import StepWork, compute_micro_batches
from trainguard.live.ordered_sum import computed_by, my_micro_batches, reduce_rows
from trainguard.live.quorum import Quorum
from trainguard.live.sharded_params import row_squares


def set_whole_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


class ReplicaLayout:
    kind = LayoutKind.REPLICA
    marks_span_step = False  # no collective before the sum

    def __init__(self, model: torch.nn.Module, link: EpochLink, rank: int, micro_batches: int):
        self.model, self.link, self.rank, self.micro_batches = model, link, rank, micro_batches

    def my_micro_batches(self, exchange: Exchange) -> list[int]:
        return my_micro_batches(self.micro_batches, len(exchange.members), exchange.members.index(self.rank))

    def computed_by(self, exchange: Exchange) -> list[int]:
        return computed_by(self.micro_batches, exchange.members)

    def compute(self, work: StepWork, exchange: Exchange, mine: list[int], catch: bool
                ) -> tuple[dict[int, torch.Tensor], str | None]:
        return compute_micro_batches(self.model, work, mine, catch)

    def reduce(self, exchange: Exchange, computed: dict[int, torch.Tensor], flags: list[int],
               extras: torch.Tensor | None) -> StepSum:
        first = next(iter(computed.values()))
        rows = torch.zeros(self.micro_batches, first.numel(), dtype=first.dtype)
        for micro_batch, row in computed.items():
            rows[micro_batch] = row
        total, counts, extras = reduce_rows(self.link.group, rows, flags, self.link.wait, extras)
        summed = StepSum(total[:-1], float(total[-1]), counts, extras)
        set_whole_grads(self.model, summed.gradient)
        return summed

    def row_squares(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return row_squares(grads)

    def over_shards(self, mine: torch.Tensor) -> torch.Tensor:
        return mine.unsqueeze(0)

    def whole_state(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def at_rest(self) -> bool:
        return True  # nothing is ever gathered

    def left_out(self, quorum: Quorum) -> None:
        """A whole replica rejoins alone: nothing to end."""

    def waiting_beat(self, epoch: int) -> Callable[[], None]:
        return self.link.beat
