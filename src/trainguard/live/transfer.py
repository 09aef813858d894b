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
    load it, everyone else passes it on. The sizes travel first, every shard's in one all-reduce, and the
    broadcasts are all started before any is waited for: two waits for the whole transfer, where each wait
    is a round of every member being scheduled (the survivors' pause). Returns the bytes this rank sent or
    loaded."""
    survivors = [member for member in quorum.members if member not in quorum.joining]
    lowest = survivors[0]
    order = [shard_of(lowest, group_size)] + [s for s in range(group_size) if s != shard_of(lowest, group_size)]
    sources = [next(member for member in survivors if shard_of(member, group_size) == shard) for shard in order]
    sizes = torch.zeros(len(sources), dtype=torch.int64)
    sent = _payload(state) if rank in sources else None
    if sent is not None:
        sizes[sources.index(rank)] = sent.numel()  # one member's size added to zeros: exact
    wait(group.allreduce([sizes]))
    payloads = [sent if source == rank else torch.empty(int(size), dtype=torch.uint8)
                for source, size in zip(sources, sizes.tolist(), strict=True)]
    works = [group.broadcast(payload, quorum.index(source)) for source, payload in zip(sources, payloads, strict=True)]
    for work in works:
        wait(work)
    if rank not in quorum.joining:
        return 0 if sent is None else sent.numel()
    mine = order.index(shard_of(rank, group_size))
    agreed = _loaded(payloads[0])
    state.load(agreed if mine == 0 else _loaded(payloads[mine]), run_state=agreed)
    return int(sizes[mine])


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
        payload = _payload(sent)
        size[0] = payload.numel()
    wait(group.broadcast(size, source_index))
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    wait(group.broadcast(payload, source_index))
    return int(size[0]), _loaded(payload) if keep else None


def _payload(state: LiveState) -> torch.Tensor:
    return torch.frombuffer(bytearray(serialised(state.state_dict())), dtype=torch.uint8)


def _loaded(payload: torch.Tensor) -> dict:
    """A peer's state bytes, loaded without executing anything (``weights_only``)."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
