"""Our own row shards in each replica group (``parallel.dp_shard`` > 1, a plain model): each rank keeps its
``torch.chunk`` rows of every parameter (``sharded_params``), gathers them whole from its group around a
step's micro-batches (and around a forward of the loop's body between steps), and the step's sum is the
group reduce-scatter plus cross-group sum of ``group_reduce``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from trainguard.live.group_reduce import Exchange, SlotLayout, StepSum, reduce_sharded, tree_sum
from trainguard.live.layout import EpochLink, LayoutKind, over_group_shards
from trainguard.live.micro_batch import StepWork, compute_micro_batches
from trainguard.live.quorum import Quorum
from trainguard.live.shards import shard_of
from trainguard.live.sharded_params import ShardedParams


class RowsLayout:
    kind = LayoutKind.ROWS
    marks_span_step = True  # from the unshard on

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, link: EpochLink, rank: int,
                 group_size: int, slots: SlotLayout):
        self.model, self.optimizer, self.link = model, optimizer, link
        self.rank, self.group_size, self.shard, self.slots = rank, group_size, shard_of(rank, group_size), slots
        self.params = ShardedParams(model, group_size, rank)
        self.forward_gathered = False  # the parameters were gathered for a forward outside a step
        model.register_forward_pre_hook(self.gather_for_forward)  # the loop body's forward, between steps
        model.register_forward_hook(self.free_after_forward)

    def my_micro_batches(self, exchange: Exchange) -> list[int]:
        return exchange.my_micro_batches()

    def computed_by(self, exchange: Exchange) -> list[int]:
        return self.slots.computed_by(exchange.live_groups())

    def unshard(self) -> None:
        self.params.unshard(self.link.group, self.link.quorum.members, self.rank, self.link.wait_all)

    def compute(self, work: StepWork, exchange: Exchange, mine: list[int], catch: bool
                ) -> tuple[dict[int, torch.Tensor], str | None]:
        """``compute_micro_batches`` with the parameters gathered whole around it (already whole after a
        forward between steps whose gather recovered from a failed epoch)."""
        if not self.params.is_whole:
            self.unshard()
        try:
            return compute_micro_batches(self.model, work, mine, catch)
        finally:
            self.params.reshard()

    def reduce(self, exchange: Exchange, computed: dict[int, torch.Tensor], flags: list[int],
               extras: torch.Tensor | None) -> StepSum:
        slots = {group: tree_sum([computed[m] for m in self.slots.slot_micro_batches(group, self.shard)])
                 for group in exchange.my_groups()}
        summed = reduce_sharded(self.link.group, exchange, slots, self.params.shard_flat,
                                self.params.shard_length(self.shard), flags, self.link.wait, extras)
        self.params.set_grads(summed.gradient)
        return summed

    def row_squares(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.params.whole_row_squares(self.link.group, self.link.quorum.members, self.rank, grads,
                                             self.link.wait_all)

    def over_shards(self, mine: torch.Tensor) -> torch.Tensor:
        return over_group_shards(self.link, self.rank, self.group_size, mine)

    def whole_state(self) -> contextlib.AbstractContextManager[None]:
        return self.params.whole(self.link.group, self.link.quorum.members, self.rank, self.optimizer,
                                 self.link.wait_all)

    def at_rest(self) -> bool:
        return not self.params.is_whole

    def left_out(self, quorum: Quorum) -> None:
        """A rank of row shards rejoins alone, receiving its shard from a live replica of it."""

    def waiting_beat(self, epoch: int) -> Callable[[], None]:
        return self.link.beat

    def gather_for_forward(self, module: torch.nn.Module, args: object) -> None:
        """Between steps the parameters are rows: a forward there (the loop's body) gathers them first,
        from this rank's group (its ranks all make that forward); a step's own forwards find them whole.
        A failure of that gather ends the epoch as in a step (``recover``: this rank may rejoin with a
        peer's state); the parameters gathered after it then stay whole for the next step, whose own
        gather the group's other ranks may already have made with this one."""
        if self.params.is_whole:
            return
        recovered = False
        while True:
            try:
                self.unshard()
                break
            except RuntimeError as error:
                self.link.recover(error)
                recovered = True
        self.forward_gathered = not recovered

    def free_after_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self.forward_gathered:
            self.forward_gathered = False
            self.params.reshard()
