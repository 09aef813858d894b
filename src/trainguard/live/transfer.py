"""The state a joining rank receives from a live peer at a step boundary, over the new epoch's group.

Parameters, optimizer state and the guards' state (``step_guards``) travel as a ``torch.save`` byte
buffer broadcast from a live replica of each shard (``shards``; with replica groups of one rank, the
whole state from one member); the receiver loads it with ``weights_only=True`` (a peer's bytes never
execute code). The data position
and the RNGs need nothing more: the data is a function of the step (``workload``), and a
micro-batch's random draws are seeded from the run's seed, the step and the micro-batch (``rng``).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainguard.checkpoint.staging import serialised
from trainguard.live.quorum import Quorum
from trainguard.live.step_guards import LiveGuards
from trainguard.live.shards import shard_of


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, guards: LiveGuards) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "guards": guards.state_dict()}


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, guards: LiveGuards, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    guards.load_state_dict(state["guards"])


def send_shards(group: dist.ProcessGroup, quorum: Quorum, rank: int, group_size: int, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, guards: LiveGuards, wait: Callable[[dist.Work], None]) -> int:
    """A join's state transfer: for each shard of a replica group, one broadcast from its lowest live
    replica (a member that is not joining); the joiners holding that shard load it, everyone else
    passes it on. Returns the bytes this rank sent or loaded."""
    survivors = [member for member in quorum.members if member not in quorum.joining]
    moved = 0
    for shard in range(group_size):
        source = next(member for member in survivors if shard_of(member, group_size) == shard)
        load = rank in quorum.joining and shard_of(rank, group_size) == shard
        size = _broadcast_state(group, quorum.index(source), rank == source, load, model, optimizer, guards, wait)
        moved += size if rank == source or load else 0
    return moved


def repair_from(group: dist.ProcessGroup, quorum: Quorum, rank: int, source: int, faulty: tuple[int, ...],
                model: torch.nn.Module, optimizer: torch.optim.Optimizer, guards: LiveGuards,
                wait: Callable[[dist.Work], None]) -> int:
    """A replica's state found corrupt (``live/fingerprint.py``): one broadcast of the agreeing replica
    ``source``'s state, which the ``faulty`` ranks load; every member takes part. Returns the bytes."""
    return _broadcast_state(group, quorum.index(source), rank == source, rank in faulty, model, optimizer, guards,
                            wait)


def _broadcast_state(group: dist.ProcessGroup, source_index: int, is_source: bool, load: bool,
                     model: torch.nn.Module, optimizer: torch.optim.Optimizer, guards: LiveGuards,
                     wait: Callable[[dist.Work], None]) -> int:
    size = torch.zeros(1, dtype=torch.int64)
    payload = None
    if is_source:
        payload = torch.frombuffer(bytearray(serialised(state_of(model, optimizer, guards))), dtype=torch.uint8)
        size[0] = payload.numel()
    wait(group.broadcast(size, source_index))
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    wait(group.broadcast(payload, source_index))
    if load:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        load_state(model, optimizer, guards, state)
    return int(size[0])
