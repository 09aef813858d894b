"""FSDP2's all-gather and reduce-scatter of a replica group, sent over the live epoch's group.

``fully_shard`` talks on its mesh's process group (here the replica group's default group,
``replica_mesh``), and its waits watch nothing: a SIGSTOPped peer costs gloo's whole timeout. So every
FSDP module's collectives are replaced (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) by
sends and receives between the group's ranks on the current epoch's gloo group, waited for by the
worker's ``wait_group`` (it raises once a rank of this replica group is declared dead). The
reduce-scatter adds the group's ranks' chunks in position order (``tree_sum``): a fixed order, so a
group computing another group's share at the same positions gets bitwise that group's partial. Each
exchange carries the ranks' statuses beside the data, in the same round (``GroupLink``): a rank whose loss
raised mid-FSDP2 says so there, and the whole group leaves the share at that exchange (``fsdp_share``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainguard.errors import ConfigError
from trainguard.live.group_reduce import tree_sum
from trainguard.live.shards import shard_of

FSDP_TAG = 11  # the tag of FSDP2's sends and receives on the epoch's group (sharded_params' gathers use 7)
STATUS_TAG = 12  # the tag of each rank's header beside each of FSDP2's exchanges (``GroupLink``)
SHARE_OK, SHARE_FAILED = 0, 1


@dataclass(frozen=True)
class GroupChannel:
    """Where this rank's replica group talks now: the epoch's group, its members (ascending: a member's
    index is its rank in the group) and the wait for sends and receives."""
    group: dist.ProcessGroup
    members: list[int]
    wait_group: Callable[[list[dist.Work]], None]


class PeerShareFailed(RuntimeError):
    """A rank of this replica group said, in place of an exchange, that its share of the step failed (its
    loss or backward raised): this rank leaves the share at the same exchange."""


def header(status: int, sent: torch.Tensor | None = None, expected: torch.Tensor | None = None) -> torch.Tensor:
    """What a rank sends each peer beside an exchange: its status, the bytes it sends that peer and the
    bytes it expects from it (none from a failed rank)."""
    return torch.tensor([status, 0 if sent is None else sent.nbytes, 0 if expected is None else expected.nbytes])


class GroupLink:
    """This rank's place in its replica group and the channel of the current epoch, shared by FSDP2's
    all-gather and reduce-scatter. Each exchange sends every peer a header (``header``: the status and the
    sizes) beside the data, both in flight at once, so an exchange costs one round trip. A rank whose share
    failed mid-FSDP2 does not know which exchange its peers wait in, nor its size: it sends ``SHARE_FAILED``
    headers in place of its next exchange (``fail_share``), reads the sizes from its peers' headers and
    answers their data with as many bytes, so every rank of the group leaves the share at that same
    exchange with no send or receive left unmatched (a failing rank that said nothing would leave its
    peers waiting in that exchange until a timeout).
    ``collective_error``: the error of the last exchange that failed (a peer lost), which no retry cures.
    With tensor parallel (``tp`` > 1) FSDP2's group is the replica group's ranks at this rank's ``tp``
    coordinate (its mesh's ``dp_shard`` dimension): ``group_size`` and ``position`` are counted in it."""

    def __init__(self, rank: int, group_size: int, channel: Callable[[], GroupChannel], tp: int = 1):
        self.rank, self.group_size, self.channel, self.tp = rank, group_size // tp, channel, tp
        in_group = shard_of(rank, group_size)
        self.position = in_group // tp
        self.first = rank - in_group + in_group % tp  # the rank at position 0 of FSDP2's group
        self.collective_error: BaseException | None = None

    def rank_at(self, position: int) -> int:
        return self.first + position * self.tp

    def swap(self, outgoing: Callable[[int], torch.Tensor], incoming: Callable[[int], torch.Tensor]) -> None:
        """Sends ``outgoing(k)`` to the group's rank at position ``k`` and receives ``incoming(k)`` from it,
        for every other position, with the headers; ``PeerShareFailed`` once done if a peer's header said its
        share failed (what that peer sent is zeros)."""
        pairs = {position: (outgoing(position), incoming(position)) for position in range(self.group_size)
                 if position != self.position}
        headers = self.round(lambda position, peer, channel: [
            channel.group.send([pairs[position][0]], peer, FSDP_TAG),
            channel.group.recv([pairs[position][1]], peer, FSDP_TAG)],
            lambda position: header(SHARE_OK, *pairs[position]))
        failed = [self.rank_at(position) for position, theirs in headers.items() if int(theirs[0]) == SHARE_FAILED]
        if failed:
            raise PeerShareFailed(f"rank(s) {failed} of this replica group failed their share of the step")

    def fail_share(self) -> None:
        """Tells the group's other ranks, at the exchange they wait in, that this rank's share failed, and
        matches the data of those that entered it (their header says how many bytes)."""
        headers = self.round(lambda _position, _peer, _channel: [], lambda _position: header(SHARE_FAILED))

        def answer(position: int, peer: int, channel: GroupChannel) -> list[dist.Work]:
            status, theirs, mine = headers[position].tolist()
            if status == SHARE_FAILED:  # failed at the same exchange: it sends nothing and waits for nothing
                return []
            return [channel.group.recv([torch.empty(theirs, dtype=torch.uint8)], peer, FSDP_TAG),
                    channel.group.send([torch.zeros(mine, dtype=torch.uint8)], peer, FSDP_TAG)]

        self.round(answer)

    def round(self, data: Callable[[int, int, GroupChannel], list[dist.Work]],
              mine: Callable[[int], torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """One wait for ``data``'s sends and receives with each other position (given its position, its rank
        in the epoch's group and the channel) and, with ``mine``, the header sent to each and the one
        received from each (returned by position)."""
        headers: dict[int, torch.Tensor] = {}
        try:
            channel = self.channel()
            works = []
            for position in range(self.group_size):
                if position == self.position:
                    continue
                peer = channel.members.index(self.rank_at(position))
                if mine is not None:
                    headers[position] = torch.empty(3, dtype=torch.int64)
                    works.append(channel.group.recv([headers[position]], peer, STATUS_TAG))
                    works.append(channel.group.send([mine(position)], peer, STATUS_TAG))
                works.extend(data(position, peer, channel))
            channel.wait_group(works)
        except BaseException as error:
            self.collective_error = error
            raise
        return headers


class _Exchange:
    """FSDP2 calls its comms' ``allocate`` and ``__call__`` only (the interface of its ``AllGather`` and
    ``ReduceScatter``, whose module is private), so these do not derive from them."""

    def __init__(self, link: GroupLink):
        self.link = link

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class EpochAllGather(_Exchange):
    """FSDP2's all-gather: the output holds each position's input, in position order."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        link = self.link
        chunks = output_tensor.view(link.group_size, -1)
        chunks[link.position].copy_(input_tensor.view(-1))
        link.swap(lambda _position: input_tensor, lambda position: chunks[position])


class EpochReduceScatter(_Exchange):
    """FSDP2's reduce-scatter (a sum: ``fsdp_share`` asks FSDP2 for sums with no division): chunk ``k`` of
    each rank's input goes to position ``k``, which adds the chunks in position order."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the live replica group's reduce-scatter sums; FSDP2 asked for {op}")
        link = self.link
        chunks = input_tensor.view(link.group_size, -1)
        received = {position: torch.empty_like(chunks[position]) for position in range(link.group_size)
                    if position != link.position}
        link.swap(lambda position: chunks[position], lambda position: received[position])
        parts = [chunks[link.position] if position == link.position else received[position]
                 for position in range(link.group_size)]
        output_tensor.view(-1).copy_(tree_sum(parts))


def route_to_epochs(modules: Sequence[FSDPModule], rank: int, group_size: int,
                    channel: Callable[[], GroupChannel], tp: int = 1) -> GroupLink:
    """Every FSDP module's all-gather and reduce-scatter on the epoch's group; gradients summed over the
    group with no division (the step's loss is already divided by the global batch's micro-batches). A
    torch whose FSDP2 takes no custom collectives is refused in one line."""
    hooks = ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
             "reset_iter_state")
    missing = [hook for hook in hooks if not hasattr(FSDPModule, hook)]
    if missing:
        raise ConfigError(f"live recovery with an FSDP2 model needs FSDPModule.{missing[0]} (torch "
                          f"{torch.__version__} lacks it); train without fully_shard, or with a newer torch")
    link = GroupLink(rank, group_size, channel, tp)
    all_gather, reduce_scatter = EpochAllGather(link), EpochReduceScatter(link)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return link
