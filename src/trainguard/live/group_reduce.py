"""A step's gradient, sharded inside each replica group, that does not depend on which groups are alive.

The sum is one fixed binary tree over the step's micro-batch indices (``tree_sum``: a range splits at
its middle). The run's configured layout cuts that tree into nodes: slot ``(j, k)`` (replica group
``j``, position ``k`` in it) owns the contiguous micro-batches ``slot_micro_batches``, a subtree; a
group's ``g`` slots make the subtree of its range; the ``G`` groups make the root. That needs ``G·g``
a power of two dividing the micro-batches (``SlotLayout.check``).

Each step, every rank computes the tree of each slot it is responsible for (its own, and the slots at
its position of the lost groups its group took over: ``responsibilities``), whole gradients over whole
parameters. Then two exchanges over the epoch's group, each one ``all_to_all`` (gloo's, uneven splits):

1. the reduce-scatter inside a live group: rank ``(h, k)`` sends shard ``s`` of each of its slot
   gradients to rank ``(h, s)``, which adds the ``g`` slots of each group it is responsible for in
   tree order (the group partial's shard ``s``);
2. the cross-group sum: every rank sends its group partials' shard to the ranks of the same shard in
   the other live groups; each then adds the ``G`` partials in tree order (group index).

A survivor computes a lost group's slots as that group's rank of the same position would have (the
same micro-batches, the same parameters, the same random draws) and forms its partial with the same
tree, so the sum is bitwise that of a fault-free run. The bytes each rank receives per step: its shard
of every slot of its group (about one gradient) and one shard per group (``G/g`` gradients), where
the all-reduce of one row per micro-batch (``ordered_sum``) moves ``micro_batches`` gradients.

The step's loss rides as one element after each shard (summed by the same trees), and each rank's
flags (``ordered_sum``'s counts) after a stage's buffers: summed over a group in stage 1, then over
the groups in stage 2, so every member learns the same counts. The ``extras`` of ``ordered_sum`` (each
micro-batch's SDC detection values, zeros where this rank did not compute it) ride after the flags the
same way: each micro-batch is computed by one rank of the quorum, so each of its values is added to
zeros only, in both stages, and every member receives it bitwise as its rank measured it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


def tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fixed-order sum of ``values``: the first half's sum plus the second half's (half: ``len // 2``),
    recursively; a new tensor. Its shape depends on the count alone, so an aligned range's sum is a node of
    the whole range's tree (``SlotLayout``)."""
    if not values:
        raise ValueError("tree_sum of no values")
    if len(values) == 1:
        return values[0].clone()
    middle = len(values) // 2
    return tree_sum(values[:middle]) + tree_sum(values[middle:])


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class StepSum:
    """A step's sum as one rank holds it: its gradient (whole, or its shard's rows: ``ShardedParams``),
    the loss, each flag's count over the members and the extras (``ordered_sum``; None without)."""
    gradient: torch.Tensor
    loss: float
    flags: list[int]
    extras: torch.Tensor | None = None


@dataclass(frozen=True)
class SlotLayout:
    """The configured layout: ``groups`` replica groups of ``group_size`` slots (a group's ``dp_shard``
    positions), ``micro_batches`` a step. With tensor parallel (``tp`` > 1) a group holds ``group_size × tp``
    ranks, row-major (tp fastest): the ``tp`` ranks of a position compute its slot's micro-batches together."""
    groups: int
    group_size: int
    micro_batches: int
    tp: int = 1

    @property
    def ranks_per_group(self) -> int:
        return self.group_size * self.tp

    def check(self) -> None:
        """A ValueError naming what breaks the tree's alignment, if anything does."""
        slots = self.groups * self.group_size
        if not _is_power_of_two(slots) or self.micro_batches % slots:
            raise ValueError(f"sharded replica groups need dp_replicate × dp_shard ({self.groups} × "
                             f"{self.group_size} = {slots}) a power of two that divides train.micro_batches "
                             f"({self.micro_batches}), so that each rank's micro-batches are a subtree of the "
                             "step's fixed sum")

    def slot_micro_batches(self, group: int, position: int) -> list[int]:
        per_slot = self.micro_batches // (self.groups * self.group_size)
        first = (group * self.group_size + position) * per_slot
        return list(range(first, first + per_slot))

    def responsibilities(self, live_groups: Sequence[int]) -> dict[int, list[int]]:
        """Live group -> the groups whose slots its ranks compute (its own, and the lost groups dealt
        round-robin over the live groups in group order), ascending."""
        live = sorted(live_groups)
        if not live:
            raise ValueError("no live replica group")
        lost = [group for group in range(self.groups) if group not in live]
        taken = {group: [group] for group in live}
        for turn, group in enumerate(lost):
            taken[live[turn % len(live)]].append(group)
        return {group: sorted(groups) for group, groups in taken.items()}

    def computed_by(self, live_groups: Sequence[int]) -> list[int]:
        """The rank that computes each micro-batch (by index) when ``live_groups`` are alive: the rank at
        the slot's position in the live group responsible for the slot's group (its first tp rank)."""
        ranks = [0] * self.micro_batches
        for live, groups in self.responsibilities(live_groups).items():
            for group in groups:
                for position in range(self.group_size):
                    for micro_batch in self.slot_micro_batches(group, position):
                        ranks[micro_batch] = live * self.ranks_per_group + position * self.tp
        return ranks


@dataclass(frozen=True)
class Exchange:
    """Where this rank sits in the epoch: what the two stages need to know about the members."""
    members: list[int]  # the epoch's ranks, ascending (a member's index is its rank in the epoch's group)
    rank: int
    layout: SlotLayout

    @property
    def group(self) -> int:
        return self.rank // self.layout.ranks_per_group

    @property
    def shard(self) -> int:
        """This rank's position in its group (its shard of every parameter, held alike in every group)."""
        return self.rank % self.layout.ranks_per_group

    @property
    def slot(self) -> int:
        """This rank's slot position in its group: its ``dp_shard`` coordinate."""
        return self.shard // self.layout.tp

    def live_groups(self) -> list[int]:
        return sorted({member // self.layout.ranks_per_group for member in self.members})

    def my_groups(self) -> list[int]:
        """The groups whose slot at this rank's position it computes."""
        return self.layout.responsibilities(self.live_groups())[self.group]

    def my_micro_batches(self) -> list[int]:
        return [m for group in self.my_groups() for m in self.layout.slot_micro_batches(group, self.slot)]


def elements_received(layout: SlotLayout, shard_length: int, live_groups: Sequence[int], group: int) -> int:
    """The gradient elements (each shard with its loss) a rank of live group ``group`` receives from the
    others in one step's two exchanges, for a shard of ``shard_length`` elements (the flags left out)."""
    taken = layout.responsibilities(live_groups)
    stage_1 = (layout.group_size - 1) * len(taken[group]) * (shard_length + 1)
    stage_2 = sum(len(taken[other]) for other in taken if other != group) * (shard_length + 1)
    return stage_1 + stage_2


def reduce_sharded(group: dist.ProcessGroup, exchange: Exchange, slots: dict[int, torch.Tensor],
                   shard_of: Callable[[torch.Tensor, int], torch.Tensor], shard_length: int, flags: Sequence[int],
                   wait: Callable[[dist.Work], None], extras: torch.Tensor | None = None) -> StepSum:
    """This rank's shard of the step's gradient, the step's loss, each flag's count over the members and
    the ``[micro_batches, K]`` float32 ``extras``, each micro-batch's as its rank gave them (None without).

    ``slots``: for each group of ``exchange.my_groups()``, this rank's slot of it: its whole flat gradient
    followed by its loss (``tree_sum`` of its micro-batches). ``shard_of(flat, s)``: shard ``s`` of a flat
    gradient (``ShardedParams.shard_flat``), ``shard_length`` this rank's shard's length. ``wait``: ``collective.wait`` bound to the epoch."""
    flag_row = _flag_row(flags, extras)
    partials, group_flags = _reduce_in_group(group, exchange, slots, shard_of, shard_length, flag_row, wait)
    return _sum_across_groups(group, exchange, partials, shard_length, group_flags, len(flags), extras, wait)


def reduce_partials(group: dist.ProcessGroup, exchange: Exchange, shares: dict[int, torch.Tensor],
                    flags: Sequence[int], wait: Callable[[dist.Work], None],
                    extras: torch.Tensor | None = None) -> StepSum:
    """``reduce_sharded`` for groups whose reduce-scatter is already done (FSDP2's, ``fsdp_share``):
    ``shares`` holds, for each group of ``exchange.my_groups()``, this rank's shard of that group's partial
    (flat, float32) followed by this rank's slot loss of it. Stage 1 sums the losses and the flags inside
    the group; stage 2 adds the partials (each with its group's loss) in group order."""
    flag_row = _flag_row(flags, extras)
    losses = {j: share[-1:] for j, share in shares.items()}
    loss_partials, group_flags = _reduce_in_group(group, exchange, losses, lambda flat, _s: flat, 0, flag_row, wait)
    with_loss = {j: torch.cat([share[:-1], loss_partials[j]]) for j, share in shares.items()}
    shard_length = next(iter(shares.values())).numel() - 1
    return _sum_across_groups(group, exchange, with_loss, shard_length, group_flags, len(flags), extras, wait)


def _flag_row(flags: Sequence[int], extras: torch.Tensor | None) -> torch.Tensor:
    """The flags, then the extras: float32 values, exact in float64 (a -0.0 arrives +0.0, added to the zeros
    each stage's sum starts from)."""
    beside = [torch.tensor([float(flag) for flag in flags], dtype=torch.float64)]
    if extras is not None:
        beside.append(extras.to(torch.float32).flatten().to(torch.float64))
    return torch.cat(beside)


def _reduce_in_group(group: dist.ProcessGroup, exchange: Exchange, slots: dict[int, torch.Tensor],
                     shard_of: Callable[[torch.Tensor, int], torch.Tensor], shard_length: int,
                     flag_row: torch.Tensor, wait: Callable[[dist.Work], None]
                     ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Stage 1: shard s of each of my slots (and its loss), then my flags, to my group's rank of shard s;
    returns my shard of each group partial I am responsible for (its loss last) and my group's flags."""
    layout, size = exchange.layout, exchange.layout.ranks_per_group
    mine = layout.responsibilities(exchange.live_groups())[exchange.group]
    outgoing = {exchange.group * size + s: _join([_with_loss(slots[j], s, shard_of) for j in mine], flag_row)
                for s in range(size)}
    expected = {exchange.group * size + k: len(mine) * (shard_length + 1) + flag_row.numel() for k in range(size)}
    received = _all_to_all(group, exchange.members, outgoing, expected, wait)
    by_position = [_split(received[exchange.group * size + k], len(mine), flag_row.numel()) for k in range(size)]
    partials = {j: tree_sum([by_position[k][0][i] for k in range(size)]) for i, j in enumerate(mine)}
    group_flags = sum((row for _, row in by_position), torch.zeros(flag_row.numel(), dtype=torch.float64))
    return partials, group_flags


def _sum_across_groups(group: dist.ProcessGroup, exchange: Exchange, partials: dict[int, torch.Tensor],
                       shard_length: int, group_flags: torch.Tensor, flag_count: int, extras: torch.Tensor | None,
                       wait: Callable[[dist.Work], None]) -> StepSum:
    """Stage 2: my group partials' shard, then my group's flags, to the same shard of every live group;
    each rank adds the partials in tree order (group index)."""
    layout, size = exchange.layout, exchange.layout.ranks_per_group
    responsibilities = layout.responsibilities(exchange.live_groups())
    mine = responsibilities[exchange.group]
    peers = [h * size + exchange.shard for h in exchange.live_groups()]
    outgoing = {peer: _join([partials[j] for j in mine], group_flags) for peer in peers}
    expected = {peer: len(responsibilities[peer // size]) * (shard_length + 1) + group_flags.numel() for peer in peers}
    received = _all_to_all(group, exchange.members, outgoing, expected, wait)
    every: dict[int, torch.Tensor] = {}
    total_flags = torch.zeros(group_flags.numel(), dtype=torch.float64)
    for peer in peers:
        groups = responsibilities[peer // size]
        values, row = _split(received[peer], len(groups), group_flags.numel())
        every.update(zip(groups, values))
        total_flags += row
    total = tree_sum([every[j] for j in range(layout.groups)])
    counts = [int(count) for count in total_flags[:flag_count].tolist()]
    carried = None if extras is None else total_flags[flag_count:].to(torch.float32).view(extras.shape)
    return StepSum(total[:-1], float(total[-1]), counts, carried)


def _with_loss(slot: torch.Tensor, shard: int, shard_of: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    return torch.cat([shard_of(slot[:-1], shard), slot[-1:]])


def _join(values: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """One message: the values (each a shard and its loss, of one length), then the flags (float64)."""
    if any(v.dtype != torch.float32 for v in values):
        raise ValueError("the sharded reduction carries float32 gradients")
    return torch.cat([*values, flags.to(torch.float32)])


def _split(message: torch.Tensor, count: int, flags: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    body = message[:message.numel() - flags]
    return list(body.view(count, -1)) if count else [], message[message.numel() - flags:].to(torch.float64)


def _all_to_all(group: dist.ProcessGroup, members: list[int], outgoing: dict[int, torch.Tensor],
                incoming: dict[int, int], wait: Callable[[dist.Work], None]) -> dict[int, torch.Tensor]:
    """Sends ``outgoing[peer]`` to each peer named (nothing to the others) and returns, by rank, the
    ``incoming[peer]`` elements each peer named there sent to this rank (every size follows from the
    layout, so none travels)."""
    send_sizes = [outgoing[m].numel() if m in outgoing else 0 for m in members]
    receive_sizes = [incoming.get(m, 0) for m in members]
    send = torch.cat([outgoing.get(m, torch.empty(0)) for m in members])
    receive = torch.empty(sum(receive_sizes), dtype=torch.float32)
    wait(group.alltoall_base(receive, send, receive_sizes, send_sizes, dist.AllToAllOptions()))
    return {m: part for m, part, n in zip(members, receive.split(receive_sizes), receive_sizes) if n}
