"""Sharding inside a replica group: each of a group's ranks owns the optimizer state and the update of
a share of the parameters (ZeRO stage 1, as ``torch.distributed.optim.ZeroRedundancyOptimizer`` splits
them: whole parameters, the largest first to the least loaded shard).

Rank ``r`` of a run with replica groups of ``g`` ranks is shard ``r % g`` of group ``r // g``; the
replicas of a shard are the ranks with the same shard index in the other groups, which hold that
shard's optimizer state bit for bit. Each step, every rank computes the whole summed gradient (the
order-fixed sum, ``ordered_sum``), drops the gradients it does not own (the optimizer skips a
parameter whose ``grad`` is ``None`` and keeps no state for it), steps, and then copies the updated
parameters of its group's other shards from one all-gather: a copy, no arithmetic, so every rank
holds the same parameters bitwise. A replacement gets each shard's optimizer state from a live
replica of that shard (``transfer.send_shards``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def shard_owners(sizes: Sequence[int], shards: int) -> list[int]:
    """The shard owning each parameter (by its element count): the largest parameter first, to the
    shard with the fewest elements so far (ties: the lower index on both sides), deterministic on
    every rank."""
    if shards < 1:
        raise ValueError(f"shards must be ≥ 1, got {shards}")
    load = [0] * shards
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        owners[index] = shard
        load[shard] += sizes[index]
    return owners


def shard_of(rank: int, group_size: int) -> int:
    return rank % group_size


def replica_of(shard: int, group: int, group_size: int) -> int:
    """The rank holding ``shard`` in replica group ``group``."""
    return group * group_size + shard


class ShardedUpdate:
    """This rank's part of the update: which parameters it steps, and the copy of the others'."""

    def __init__(self, model: torch.nn.Module, group_size: int, rank: int):
        self.params = list(model.parameters())
        if group_size > 1 and not all(p.is_contiguous() for p in self.params):
            raise ValueError("live recovery with replica groups of several ranks shards the update by parameter: "
                             "every parameter must be contiguous")
        self.group_size, self.rank = group_size, rank
        self.owners = shard_owners([p.numel() for p in self.params], group_size)
        self.shard = shard_of(rank, group_size)
        self.lengths = [sum(_nbytes(p) for p, o in zip(self.params, self.owners) if o == s) for s in range(group_size)]

    @property
    def sharded(self) -> bool:
        return self.group_size > 1

    def drop_unowned_grads(self) -> None:
        for param, owner in zip(self.params, self.owners):
            if owner != self.shard:
                param.grad = None

    def drop_unowned_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Forgets the optimizer state of the parameters this rank's shard does not own (a checkpoint
        loaded whole brings every shard's): the state a rank of this shard holds after stepping alone."""
        for param, owner in zip(self.params, self.owners):
            if owner != self.shard:
                optimizer.state.pop(param, None)

    def gather(self, group: dist.ProcessGroup, members: list[int], wait: Callable[[dist.Work], None]) -> None:
        """Copies the parameters of this rank's group's other shards, updated by their owners, from one
        all-gather over the epoch's group (every member sends its owned parameters' bytes, any dtype,
        padded to the longest shard)."""
        mine = torch.zeros(max(self.lengths), dtype=torch.uint8)
        offset = 0
        for param, owner in zip(self.params, self.owners):
            if owner == self.shard:
                mine[offset:offset + _nbytes(param)] = _bytes_of(param.detach())
                offset += _nbytes(param)
        rows = [torch.empty_like(mine) for _ in members]
        wait(group.allgather([rows], [mine]))
        group_index = self.rank // self.group_size
        offsets = [0] * self.group_size
        with torch.no_grad():
            for param, owner in zip(self.params, self.owners):
                start = offsets[owner]
                offsets[owner] += _nbytes(param)
                if owner == self.shard:
                    continue
                row = rows[members.index(replica_of(owner, group_index, self.group_size))]
                _bytes_of(param.data).copy_(row[start:start + _nbytes(param)])


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (writes go to the tensor)."""
    return tensor.reshape(-1).view(torch.uint8)


def whole_state(shard_states: Sequence[dict]) -> dict:
    """The unsharded state of a replica group from its shards' ``{"model", "optimizer"}`` states (in
    shard order): the parameters of any shard (they are equal), the union of the optimizer states. For
    comparing runs of different layouts, and a checkpoint of the whole run."""
    first = shard_states[0]
    state: dict = {}
    for shard in shard_states:
        state.update(shard["optimizer"]["state"])
    return {"model": first["model"],
            "optimizer": {"state": dict(sorted(state.items())), "param_groups": first["optimizer"]["param_groups"]}}
