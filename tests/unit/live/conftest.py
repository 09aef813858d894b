from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.events import EventLog
from trainguard.guards.skip import SkipConfig
from trainguard.guards.step_skips import StepSkips
from trainguard.live.durable import LiveCheckpoints
from trainguard.live.state import LiveState
from trainguard.live.step_judge import LiveJudge


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


@pytest.fixture
def make_checkpoints(tmp_path, store):
    """Makes rank 0's ``LiveCheckpoints`` of ``model`` (a durable save every 5 steps, a checkpoint passed over
    after 2 failed loads) on a real store, with no other rank; ``optimizer``: plain SGD of ``model`` unless given."""
    def make(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> LiveCheckpoints:
        events = EventLog(None)
        guards = LiveJudge(StepSkips(SkipConfig(), 0, logging.getLogger("test"), events.emit, reports=lambda: False))
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
        return LiveCheckpoints(store, tmp_path, CheckpointConfig(save_interval=5), 0, model, optimizer, 1,
                               contextlib.nullcontext, LiveState(model, optimizer, guards), events,
                               timedelta(seconds=10), beat=lambda: None, world=1, ranks_per_node=1, max_load_failures=2)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def checkpoints(make_checkpoints):
    """Rank 0's ``LiveCheckpoints`` of a small model (``make_checkpoints``)."""
    return make_checkpoints(torch.nn.Linear(2, 1))
