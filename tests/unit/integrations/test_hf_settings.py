"""``GuardedTrainer``'s handling of the Trainer's settings: what cannot work is refused in one line
naming the setting; ``max_grad_norm`` becomes the guard's ``optim.grad_clip`` and stays the user's;
``save_strategy`` other than "no" is turned off with one logged line (checkpoints are trainguard's).
Also the pure pieces: the Trainer's epoch after a step, and the no-op ``step()`` of the taken-over
optimizer."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

from transformers import TrainingArguments  # noqa: E402
from transformers.trainer_utils import SaveStrategy  # noqa: E402

from trainguard.config import load_config  # noqa: E402
from trainguard.integrations.hf_trainer import GuardedTrainer, SteppedByGuard, epoch_after  # noqa: E402


def trainer(tmp_path, overrides=(), **arguments) -> GuardedTrainer:
    arguments = {"max_steps": 4, "save_strategy": "no", **arguments}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, **arguments)
    return GuardedTrainer(tmp_path / "run", guard_config=load_config(None, list(overrides)),
                          model=torch.nn.Linear(2, 1), args=args, eval_dataset=[0])  # never evaluated here


@pytest.mark.parametrize(("arguments", "overrides", "message"), [
    ({"fp16": True}, (), r"^GuardedTrainer: fp16=True is not supported \(the guard measures"),
    ({"gradient_accumulation_steps": 2}, (), r"^GuardedTrainer: gradient_accumulation_steps must be 1"),
    ({"max_steps": -1}, (), r"^GuardedTrainer: set TrainingArguments\(max_steps=N\)"),
    ({"load_best_model_at_end": True, "save_strategy": "steps", "eval_strategy": "steps"}, (),
     r"^GuardedTrainer: load_best_model_at_end=True needs the Trainer's own checkpoints"),
    ({"max_grad_norm": 0.5}, ("optim.grad_clip=2.0",),
     r"^GuardedTrainer: optim.grad_clip=2.0 in the guard config and TrainingArguments.max_grad_norm=0.5 disagree"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(tmp_path, arguments, overrides, message):
    with pytest.raises(ValueError, match=message) as refused:
        trainer(tmp_path, overrides, **arguments)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_max_grad_norm_is_the_guards_clip_and_stays_the_users(tmp_path, max_grad_norm):
    guarded = trainer(tmp_path, max_grad_norm=max_grad_norm)
    assert guarded.guard_config.optim.grad_clip == max_grad_norm
    assert guarded.args.max_grad_norm == max_grad_norm


def test_the_trainers_own_checkpoints_are_turned_off_with_one_logged_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainguard.integrations.hf_trainer"):
        guarded = trainer(tmp_path, save_strategy="steps")  # the Trainer's default
    assert guarded.args.save_strategy == SaveStrategy.NO
    (record,) = caplog.records
    assert record.getMessage() == ("GuardedTrainer: save_strategy='steps' set to 'no': checkpoints are "
                                   "trainguard's (checkpoint.save_interval)")


@pytest.mark.parametrize(("step", "per_epoch", "expected"), [(1, 64, 1 / 64), (64, 64, 1.0), (65, 64, 1 + 1 / 64),
                                                             (51, 64, 51 / 64), (130, 64, 2 + 2 / 64)])
def test_epoch_after_a_step_is_the_trainers(step, per_epoch, expected):
    # the Trainer's own formula: epoch + (step_in_epoch + 1) / steps_in_epoch
    assert epoch_after(step, per_epoch) == expected


def test_the_trainers_step_is_a_no_op_after_the_guard_took_over():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    parameter.grad = torch.ones(2)
    taken = SteppedByGuard(optimizer)
    taken.step()
    assert torch.equal(parameter.detach(), torch.ones(2))
    assert taken.param_groups is optimizer.param_groups  # everything else is the real one's
