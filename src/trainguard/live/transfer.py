"""The state a joining rank receives from a live peer at a step boundary, over the new epoch's group.

Parameters and optimizer state travel as a ``torch.save`` byte buffer broadcast from the source
member; the receiver loads it with ``weights_only=True`` (a peer's bytes never execute code). The
data position and the RNGs need nothing more: the data is a function of the step (``workload``),
and the model draws no random numbers after its seeded initialisation.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainguard.live.files import state_bytes


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def broadcast_state(group: dist.ProcessGroup, source_index: int, my_index: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, wait: Callable[[dist.Work], None]) -> int:
    """Sends (source) or receives and loads (everyone else) the state; returns the bytes moved."""
    size = torch.zeros(1, dtype=torch.int64)
    payload = None
    if my_index == source_index:
        payload = torch.frombuffer(bytearray(state_bytes(state_of(model, optimizer))), dtype=torch.uint8)
        size[0] = payload.numel()
    wait(group.broadcast(size, source_index))
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    wait(group.broadcast(payload, source_index))
    if my_index != source_index:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        load_state(model, optimizer, state)
    return int(size[0])
