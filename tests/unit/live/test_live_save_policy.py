"""``LiveCheckpoints.save`` asks the save policy before it makes anything: a step that is not due builds
no checkpoint group (a gloo process group on the quorum, its store client, its thread) and no
``CheckpointManager``. Before, every step made them, then asked the manager whether the step was due."""

from __future__ import annotations

import torch.distributed as dist

from trainguard.live.quorum import Quorum


def test_a_step_that_is_not_due_makes_no_checkpoint_group(checkpoints):
    quorum = Quorum(0, [0], 0, "start")
    for step in (1, 2, 3, 4):
        assert checkpoints.save(quorum, step, last_step=False, stopping=False) is False
    assert not dist.is_initialized() and checkpoints.manager is None and checkpoints.connection is None
