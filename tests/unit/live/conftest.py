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
def checkpoints(tmp_path, store):
    """Rank 0's ``LiveCheckpoints`` (a durable save every 5 steps) on a real store, with no other rank."""
    model = torch.nn.Linear(2, 1)
    events = EventLog(None)
    guards = LiveJudge(StepSkips(SkipConfig(), 0, logging.getLogger("test"), events.emit, reports=lambda: False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    yield LiveCheckpoints(store, tmp_path, CheckpointConfig(save_interval=5), 0, model, optimizer, 1,
                          contextlib.nullcontext, LiveState(model, optimizer, guards), events,
                          timedelta(seconds=10), beat=lambda: None, world=1, ranks_per_node=1)
    if dist.is_initialized():
        dist.destroy_process_group()
