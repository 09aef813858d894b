"""``LiveCheckpoints.save`` asks the save policy before it makes anything: a step that is not due builds
no checkpoint group (a gloo process group on the quorum, its store client, its thread) and no
``CheckpointManager``. Before, every step made them, then asked the manager whether the step was due."""

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
from trainguard.live.quorum import Quorum
from trainguard.live.state import LiveState
from trainguard.live.step_judge import LiveJudge


@pytest.fixture
def checkpoints(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    model = torch.nn.Linear(2, 1)
    events = EventLog(None)
    guards = LiveJudge(StepSkips(SkipConfig(), 0, logging.getLogger("test"), events.emit, reports=lambda: False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    yield LiveCheckpoints(store, tmp_path, CheckpointConfig(save_interval=5), 0, model, optimizer, 1,
                          contextlib.nullcontext, LiveState(model, optimizer, guards), events,
                          timedelta(seconds=10), beat=lambda: None, world=1, ranks_per_node=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_step_that_is_not_due_makes_no_checkpoint_group(checkpoints):
    quorum = Quorum(0, [0], 0, "start")
    for step in (1, 2, 3, 4):
        assert checkpoints.save(quorum, step, last_step=False, stopping=False) is False
    assert not dist.is_initialized() and checkpoints.manager is None and checkpoints.connection is None
