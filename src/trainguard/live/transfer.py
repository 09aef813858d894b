"""The state a joining rank receives from a live peer at a step boundary, over the new epoch's group.

A rank's state (``live/state.py``: its shard of the parameters and optimizer state, the engine's run
state, the guards' counters and the LR scheduler, and the loop's ``stateful`` objects) travels as a
``torch.save`` byte buffer broadcast from a live replica of each shard (``shards``; with replica
groups of one rank, the whole state from one member); the receiver loads it with ``weights_only=True``
(a peer's bytes never execute code). A joiner takes its shard from its shard's broadcast and what the
quorum must agree on (the run state, the loop's objects) from the lowest live rank's broadcast, which
every member receives anyway: whatever the survivors hold, the lowest live rank's wins. The data
position and the RNGs need nothing more: the data is a function of the step (``workload``), and a
micro-batch's random draws are seeded from the run's seed, the step and the micro-batch (``rng``).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainguard.checkpoint.staging import serialised
from trainguard.live.quorum import Quorum
from trainguard.live.shards import shard_of
from trainguard.live.state import LiveState


def send_shards(group: dist.ProcessGroup, quorum: Quorum, rank: int, group_size: int, state: LiveState,
                wait: Callable[[dist.Work], None]) -> int:
    """A join's state transfer: for each shard of a replica group, one broadcast from its lowest live
    replica (a member that is not joining), the lowest live rank's first; the joiners holding that shard
    load it, everyone else passes it on. Returns the bytes this rank sent or loaded."""
    survivors = [member for member in quorum.members if member not in quorum.joining]
    lowest = survivors[0]
    joiner = rank in quorum.joining
    order = [shard_of(lowest, group_size)] + [s for s in range(group_size) if s != shard_of(lowest, group_size)]
    moved, agreed = 0, None
    for shard in order:
        source = next(member for member in survivors if shard_of(member, group_size) == shard)
        mine = joiner and shard_of(rank, group_size) == shard
        size, received = _broadcast(group, quorum.index(source), state if rank == source else None,
                                    keep=joiner and (mine or source == lowest), wait=wait)
        if source == lowest:
            agreed = received
        if mine:
            state.load(received, run_state=agreed)
        moved += size if rank == source or mine else 0
    return moved


def repair_from(group: dist.ProcessGroup, quorum: Quorum, rank: int, source: int, faulty: tuple[int, ...],
                state: LiveState, wait: Callable[[dist.Work], None]) -> int:
    """A replica's state found corrupt (``live/fingerprint.py``): one broadcast of the agreeing replica
    ``source``'s state, whose shard and run state the ``faulty`` ranks load (their loop's objects are their
    own loop's); every member takes part. Returns the bytes."""
    size, received = _broadcast(group, quorum.index(source), state if rank == source else None,
                                keep=rank in faulty, wait=wait)
    if received is not None:
        state.undo(received)
    return size


def _broadcast(group: dist.ProcessGroup, source_index: int, sent: LiveState | None, keep: bool,
               wait: Callable[[dist.Work], None]) -> tuple[int, dict | None]:
    """One state from the member at ``source_index`` (``sent``: this rank's, when it is that member) to
    every member: the bytes, and the state loaded back when ``keep``."""
    size = torch.zeros(1, dtype=torch.int64)
    payload = None
    if sent is not None:
        payload = torch.frombuffer(bytearray(serialised(sent.state_dict())), dtype=torch.uint8)
        size[0] = payload.numel()
    wait(group.broadcast(size, source_index))
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    wait(group.broadcast(payload, source_index))
    received = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True) if keep else None
    return int(size[0]), received
