"""FSDP2's all-gather and reduce-scatter of a replica group, sent over the live epoch's group.

``fully_shard`` talks on its mesh's process group (here the replica group's default group,
``replica_mesh``), and its waits watch nothing: a SIGSTOPped peer costs gloo's whole timeout. So every
FSDP module's collectives are replaced (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) by
sends and receives between the group's ranks on the current epoch's gloo group, waited for by the
worker's ``wait_group`` (it raises once a rank of this replica group is declared dead). The
reduce-scatter adds the group's ranks' chunks in position order (``tree_sum``): a fixed order, so a
group computing another group's share at the same positions gets bitwise that group's partial. Each
exchange carries the ranks' statuses in the messages of its data, a header before the data (``GroupLink``):
a rank whose loss raised mid-FSDP2 says so there, and the whole group leaves the share at that exchange
(``fsdp_share``).
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

FSDP_TAG = 11  # the tag of FSDP2's exchanges on the epoch's group (sharded_params' gathers use 7)
SHARE_OK, SHARE_FAILED = 0, 1
HEADER_BYTES = 16  # a message's header: its status and the bytes of data after it, two int64
BYTES_PER_ELEMENT_BOUND = 8  # no dtype FSDP2 gathers or reduces in is wider
SEND, RECEIVE = "send", "receive"


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


def message(status: int, data: torch.Tensor | None = None) -> torch.Tensor:
    """One exchange's message to a peer, as bytes: the header (``status``, the data's bytes), then the data."""
    nbytes = 0 if data is None else data.nbytes
    packed = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
    packed[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([status, nbytes]))
    if data is not None:
        packed[HEADER_BYTES:].copy_(data.reshape(-1).view(torch.uint8))
    return packed


def largest_exchange_bytes(modules: Sequence[FSDPModule]) -> int:
    """A bound on the data one rank sends a peer in one of FSDP2's exchanges of these modules: a param
    group's all-gather input or reduce-scatter chunk holds each parameter's padded shard, in a dtype of at
    most ``BYTES_PER_ELEMENT_BOUND`` bytes. FSDP2 keeps the padded sizes on its own parameter objects only."""
    return max((sum(fsdp_param.padded_sharded_param_size.numel() for fsdp_param in param_group.fsdp_params)
                * BYTES_PER_ELEMENT_BOUND
                for module in modules for param_group in module._get_fsdp_state()._fsdp_param_groups), default=0)


class GroupLink:
    """This rank's place in its replica group and the channel of the current epoch, shared by FSDP2's
    all-gather and reduce-scatter. An exchange is one message each way between every two ranks of the
    group (``message``: a header, then the data): one round trip, one send and one receive per peer. A
    rank whose share failed mid-FSDP2 does not know which exchange its peers wait in, nor its size: in
    place of its next exchange it sends every peer a ``SHARE_FAILED`` header alone (gloo delivers a
    message shorter than the receive posted for it) and receives each peer's message into a buffer of
    ``largest_bytes`` of data (``fail_share``), so every rank of the group leaves the share at that same
    exchange with no send or receive left unmatched (a failing rank that said nothing would leave its
    peers waiting in that exchange until a timeout). ``largest_bytes``: a bound on the data a rank sends a
    peer in one exchange (``largest_exchange_bytes``); an exchange above it is refused before it starts.
    ``collective_error``: the error of the last exchange that failed (a peer lost), which no retry cures.
    With tensor parallel (``tp`` > 1) FSDP2's group is the replica group's ranks at this rank's ``tp``
    coordinate (its mesh's ``dp_shard`` dimension): ``group_size`` and ``position`` are counted in it."""

    def __init__(self, rank: int, group_size: int, channel: Callable[[], GroupChannel], largest_bytes: int,
                 tp: int = 1):
        self.rank, self.group_size, self.channel, self.tp = rank, group_size // tp, channel, tp
        self.largest_bytes = largest_bytes
        in_group = shard_of(rank, group_size)
        self.position = in_group // tp
        self.first = rank - in_group + in_group % tp  # the rank at position 0 of FSDP2's group
        self.collective_error: BaseException | None = None
        self.buffers: dict[tuple[int, str, int], torch.Tensor] = {}  # ``buffer``'s, by (position, use, bytes)

    def rank_at(self, position: int) -> int:
        return self.first + position * self.tp

    def peers(self) -> list[int]:
        return [position for position in range(self.group_size) if position != self.position]

    def swap(self, outgoing: Callable[[int], torch.Tensor], incoming: Callable[[int], torch.Tensor]) -> None:
        """Sends ``outgoing(k)`` to the group's rank at position ``k`` and receives ``incoming(k)`` from it,
        for every other position; ``PeerShareFailed`` once done if a peer's header said its share failed
        (``incoming`` from that peer is left as it was)."""
        targets = {position: incoming(position) for position in self.peers()}
        sent: dict[int, torch.Tensor] = {}  # the all-gather sends one tensor to every peer: packed once
        messages = {}
        for position in targets:
            data = outgoing(position)
            if data.nbytes > self.largest_bytes or targets[position].nbytes > self.largest_bytes:
                raise RuntimeError(f"live FSDP2 exchange of {max(data.nbytes, targets[position].nbytes)} bytes, "
                                   f"above the bound of {self.largest_bytes} a failed peer's answer is received in")
            packed = sent.get(id(data))
            if packed is None:
                packed = sent[id(data)] = self.buffer((position, SEND), data.nbytes)
                packed[HEADER_BYTES:].copy_(data.reshape(-1).view(torch.uint8))
            messages[position] = (packed, self.buffer((position, RECEIVE), targets[position].nbytes))
        failed = []
        for position, received in self.round(messages).items():
            status, nbytes = received[:HEADER_BYTES].view(torch.int64).tolist()
            if status == SHARE_FAILED:
                failed.append(self.rank_at(position))
                continue
            if nbytes != targets[position].nbytes:
                raise RuntimeError(f"live FSDP2 exchange: rank {self.rank_at(position)} sent {nbytes} bytes where "
                                   f"rank {self.rank} expected {targets[position].nbytes}: the group's ranks are "
                                   "in different exchanges")
            targets[position].reshape(-1).view(torch.uint8).copy_(received[HEADER_BYTES:])
        if failed:
            raise PeerShareFailed(f"rank(s) {failed} of this replica group failed their share of the step")

    def buffer(self, use: tuple[int, str], nbytes: int) -> torch.Tensor:
        """The message buffer kept for ``use`` (a peer's position, sending or receiving) and ``nbytes`` of data,
        its header ``SHARE_OK`` and the size: FSDP2's exchanges repeat their sizes every step, and a buffer
        made per exchange with its header written cost as much CPU as the messages it saved."""
        kept = self.buffers.get((*use, nbytes))
        if kept is None:
            kept = self.buffers[(*use, nbytes)] = message(SHARE_OK, torch.empty(nbytes, dtype=torch.uint8))
        return kept

    def fail_share(self) -> None:
        """Tells the group's other ranks, at the exchange they wait in, that this rank's share failed, and
        receives what each sent there (a peer that failed too sends its header alone)."""
        said = message(SHARE_FAILED)
        self.round({position: (said, torch.empty(HEADER_BYTES + self.largest_bytes, dtype=torch.uint8))
                    for position in self.peers()})

    def round(self, messages: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """One wait for the sends of ``messages[k][0]`` to the rank at position ``k`` and the receives into
        ``messages[k][1]`` from it; returns the received buffers by position."""
        try:
            channel = self.channel()
            works = []
            for position, (send, receive) in messages.items():
                peer = channel.members.index(self.rank_at(position))
                works.append(channel.group.recv([receive], peer, FSDP_TAG))
                works.append(channel.group.send([send], peer, FSDP_TAG))
            channel.wait_group(works)
        except BaseException as error:
            self.collective_error = error
            self.buffers.clear()  # a receive given up may still land in its buffer: none is used again
            raise
        return {position: receive for position, (_send, receive) in messages.items()}


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
    link = GroupLink(rank, group_size, channel, largest_exchange_bytes(modules), tp)
    all_gather, reduce_scatter = EpochAllGather(link), EpochReduceScatter(link)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return link
