"""Issue 35 item 2: a checkpoint saved without an object the resuming run checkpoints (a scheduler added
since, a live run's ``scheduler`` entry) restarted that object silently; it now says so once, naming the
checkpoint and the object."""

from __future__ import annotations

import logging

import torch

from trainguard.checkpoint.manager import CheckpointManager


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_resuming_from_a_checkpoint_without_the_schedulers_state_warns_once_naming_both(tmp_path, caplog):
    model, optimizer = _model_and_optimizer()
    saved = CheckpointManager(tmp_path, model, optimizer, async_save=False, keep_last=2)
    saved.save_durable(3)
    saved.close()
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    resuming = CheckpointManager(tmp_path, model, optimizer, {"scheduler": scheduler}, async_save=False, keep_last=2,
                                 resume="auto")
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        assert resuming.resume() == 3
    resuming.close()
    lines = [record.getMessage() for record in caplog.records if "holds no state" in record.getMessage()]
    assert lines == [f"resuming from {tmp_path / 'checkpoints' / 'global_step_3'}: it holds no state for "
                     "'scheduler' (saved without them); they start from their initial state"]
    assert scheduler.last_epoch == 0
