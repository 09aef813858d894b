"""FSDP2 inside each replica group: the script shards its model with ``fully_shard`` over the replica
group's mesh (``replica_mesh``; ``(dp_shard, tp)`` with tensor parallel, ``parallel.tp`` > 1). Each group's
share of a step is computed by FSDP2, one reduce-scatter (``fsdp_share``), its collectives on the epoch's
group (``fsdp_comms``); the shares' partials are added across groups in group order
(``group_reduce.reduce_partials``). A rank of a group left out of an epoch ends (``GroupOut``): its group's
processes start again together and make a new default group for their mesh (``replica_mesh``)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainguard.live.dtensor_state import owned_square_sum
from trainguard.live.fsdp_comms import GroupChannel
from trainguard.live.fsdp_share import FsdpShares, ShareAbandoned, fsdp_modules, local
from trainguard.live.group_reduce import Exchange, SlotLayout, StepSum, reduce_partials, tree_sum
from trainguard.live.layout import EpochLink, LayoutKind, over_group_shards
from trainguard.live.micro_batch import StepWork
from trainguard.live.quorum import Quorum, fence_key, has
from trainguard.live.shards import shard_of
from trainguard.live.sharded_params import gather_rows, row_squares
from trainguard.live.wait_thread import WaitThread


class GroupOut(Exception):
    """This rank's FSDP2 replica group left the quorum: its processes end and are started again together,
    so that the new ones make a new default group for their mesh (``replica_mesh``)."""


class FsdpLayout:
    kind = LayoutKind.FSDP
    marks_span_step = True  # from FSDP2's first all-gather on

    def __init__(self, model: torch.nn.Module, link: EpochLink, rank: int, group_size: int, slots: SlotLayout):
        self.link, self.rank, self.group_size, self.slots, self.tp = link, rank, group_size, slots, slots.tp
        self.shard = shard_of(rank, group_size)
        self.group_waits = WaitThread("fsdp-group-wait")  # wait_group's, kept across FSDP2's exchanges
        self.fsdp = FsdpShares(model, fsdp_modules(model), rank, group_size, self.group_channel, self.tp)
        # FSDP2 registers its unsharded parameters on the modules while it computes, its sharded ones again after
        self.model, self.sharded = model, list(model.parameters())

    def my_micro_batches(self, exchange: Exchange) -> list[int]:
        return exchange.my_micro_batches()

    def computed_by(self, exchange: Exchange) -> list[int]:
        return self.slots.computed_by(exchange.live_groups())

    def group_channel(self) -> GroupChannel:
        """Where FSDP2's collectives of this rank's replica group go now (``fsdp_comms``)."""
        return GroupChannel(self.link.group, self.link.quorum.members, self.wait_group)

    def dead_group_peers(self, epoch: int) -> list[int]:
        """The other ranks of this rank's replica group declared dead in ``epoch`` (their fence raised)."""
        first, store = self.rank - self.shard, self.link.store
        return [peer for peer in range(first, first + self.group_size)
                if peer != self.rank and has(store, fence_key(peer)) and int(store.get(fence_key(peer))) >= epoch]

    def wait_group(self, works: list[dist.Work]) -> None:
        """Waits for sends and receives inside this rank's replica group: ended by the death of a rank of the
        group (its fence raised in this epoch), not by the epoch's abort key. A survivor computing its share
        while another group's rank dies finishes that share's collectives, so its FSDP2 state is never left
        inside a forward or backward; the failure reaches it in the cross-group sum."""
        epoch = self.link.quorum.epoch

        def ended() -> str | None:
            dead = self.dead_group_peers(epoch)
            return f"epoch {epoch}: rank(s) {dead} of this replica group died during an FSDP2 collective" if dead else None

        self.group_waits.wait(works, ended, self.link.beat)

    def compute(self, work: StepWork, exchange: Exchange, mine: list[int], catch: bool
                ) -> tuple[dict[int, torch.Tensor], str | None]:
        """This rank's rows of each share it computes (its group's, and the lost groups' dealt to it), by
        group, each with its loss last (``fsdp_share``), and the line of this rank's error when its
        computation raised. Once a share is abandoned (this rank's or a group peer's computation raised:
        every rank of the group abandons the same one) the rest are zeros: the step is not committed, and
        the quorum computes it again. Without ``catch`` (SDC detection's rerun, which left FSDP2 between
        steps) a share that raises ends this rank (``ShareAbandoned``), as a raise in the rows path's
        rerun does."""
        computed: dict[int, torch.Tensor] = {}
        failure, abandoned = None, False
        for group in exchange.my_groups():
            if not abandoned:
                try:
                    computed[group] = self.fsdp.share(work.loss_of, work.position,
                                                      self.slots.slot_micro_batches(group, exchange.slot),
                                                      work.micro_batches, work.seed, work.beat, work.measure)
                    continue
                except ShareAbandoned as share:
                    failure, abandoned = share.failure, True
            computed[group] = torch.zeros(self.fsdp.local_numel() + 1)
        if exchange.shard % self.tp:  # a slot's tp peers computed its loss alike: its first tp rank counts
            for share in computed.values():
                share[-1] = 0.0
        if failure is not None and not catch:
            raise ShareAbandoned(f"rank {self.rank}: SDC detection's rerun of step {work.step}: {failure}")
        return computed, failure

    def reduce(self, exchange: Exchange, computed: dict[int, torch.Tensor], flags: list[int],
               extras: torch.Tensor | None) -> StepSum:
        summed = reduce_partials(self.link.group, exchange, computed, flags, self.link.wait, extras)
        self.fsdp.set_grads(summed.gradient)
        return summed

    def row_squares(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.tp > 1:
            # a tensor-parallel shard is no set of rows: each parameter's squares summed on every rank of the
            # group over what it owns, added in position order (every group's alike)
            owned = torch.stack([owned_square_sum(grad, self.shard % self.tp) for grad in grads])
            return list(tree_sum(list(self.over_shards(owned))).unsqueeze(1))
        rows = [torch.Size([param.shape[0]]) for param in self.fsdp.params]
        return gather_rows(self.link.group, self.link.quorum.members, self.rank, self.group_size,
                           row_squares([local(grad) for grad in grads]), rows, self.link.wait_all)

    def over_shards(self, mine: torch.Tensor) -> torch.Tensor:
        return over_group_shards(self.link, self.rank, self.group_size, mine)

    def whole_state(self) -> contextlib.AbstractContextManager[None]:
        """DCP reads and writes FSDP2's DTensors as they are: nothing to gather."""
        return contextlib.nullcontext()

    def at_rest(self) -> bool:
        return all(param is sharded for param, sharded in zip(self.model.parameters(), self.sharded))

    def left_out(self, quorum: Quorum) -> None:
        """A rank left out of ``quorum`` ends (``GroupOut``): its group's processes start again together
        (``replica_mesh``), the replacements join as one group."""
        self.link.events.emit("live_group_out", step=self.link.step_index, epoch=quorum.epoch, pid=os.getpid())
        raise GroupOut(f"rank {self.rank}: its FSDP2 replica group is out of epoch {quorum.epoch}; its processes "
                       "start again together")

    def waiting_beat(self, epoch: int) -> Callable[[], None]:
        return self.link.beat if self.tp == 1 else functools.partial(self.beat_unless_group_lost, epoch)

    def beat_unless_group_lost(self, epoch: int) -> None:
        """With tensor parallel, a rank waiting for the next epoch ends (``GroupOut``) as soon as a rank of its
        replica group is declared dead in ``epoch``: the group is left out whole anyway, and a tp peer of
        this rank may wait in a tp collective this rank left (those are not watched), until its process
        ends and closes the connection; otherwise the lighthouse waits for that peer until ``hang_s``."""
        self.link.beat()
        dead = self.dead_group_peers(epoch)
        if dead:
            self.link.events.emit("live_group_out", step=self.link.step_index, epoch=epoch, pid=os.getpid())
            raise GroupOut(f"rank {self.rank}: rank {dead[0]} of its tensor-parallel replica group died in epoch "
                           f"{epoch}; its processes start again together")
