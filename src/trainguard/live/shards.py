"""Sharding inside a replica group: names, and a group's whole state from its shards.

Rank ``r`` of a run with replica groups of ``g`` ranks is shard ``r % g`` of group ``r // g``; the
replicas of a shard are the ranks with the same shard index in the other groups, which hold that
shard's parameter rows and optimizer state bit for bit (``sharded_params``). A replacement gets its
shard's state from a live replica of that shard (``transfer.send_shards``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shard_of(rank: int, group_size: int) -> int:
    return rank % group_size


def whole_state(shard_states: Sequence[dict]) -> dict:
    """The unsharded state of a replica group from its shards' ``{"model", "optimizer"}`` states (in
    shard order): each parameter's and each optimizer state tensor's rows put back together along dim 0
    (``sharded_params``), a scalar (Adam's ``step``) taken from the first shard. For comparing runs of
    different layouts."""
    first = shard_states[0]
    model = {key: _joined([shard["model"][key] for shard in shard_states]) for key in first["model"]}
    state = {index: {name: _joined([shard["optimizer"]["state"][index][name] for shard in shard_states])
                     for name in entry}
             for index, entry in first["optimizer"]["state"].items()}
    return {"model": model,
            "optimizer": {"state": dict(sorted(state.items())), "param_groups": first["optimizer"]["param_groups"]}}


def _joined(parts: list) -> object:
    if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0:
        return torch.cat(parts)
    return parts[0]
