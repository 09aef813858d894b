"""The launcher's flags and a user script's own flags on one command line (``LiveArgs.parse``), and the
gradient live mode takes of one micro-batch (its share of the step's mean loss)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from trainguard.live.micro_batch import micro_batch_grad
from trainguard.live.worker import LiveArgs

LAUNCHER = ["--store", "127.0.0.1:29500", "--rank", "2", "--world", "4", "--steps", "60", "--run-dir", "runs/live",
            "--micro-batches", "8", "--checkpoint-every", "10"]


def test_the_launchers_flags_and_the_scripts_own_flags_coexist():
    argv = ["--lr", "3e-3", *LAUNCHER]
    args = LiveArgs.parse(argv)
    assert (args.rank, args.spare, args.world, args.steps, args.micro_batches) == (2, None, 4, 60, 8)
    assert args.run_dir == Path("runs/live") and args.checkpoint_every == 10 and not args.rejoin
    own = argparse.ArgumentParser()
    own.add_argument("--lr", type=float)
    assert own.parse_known_args(argv)[0].lr == 3e-3


def test_a_missing_launcher_flag_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        LiveArgs.parse([flag for flag in LAUNCHER if flag not in ("--micro-batches", "8")])
    assert exit_.value.code == 2 and "--micro-batches" in capsys.readouterr().err


def test_the_micro_batch_gradients_add_up_to_the_gradient_of_the_mean_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = torch.randn(4, 5, 3)  # 4 micro-batches of 5 samples

    def loss_of(model, step, micro_batch):
        return model(data[micro_batch]).pow(2).mean()

    shares, grads = zip(*(micro_batch_grad(model, loss_of, 0, m, 4, seed=0) for m in range(4)))
    model.zero_grad()
    mean = torch.stack([loss_of(model, 0, m) for m in range(4)]).mean()
    mean.backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(sum(grads), expected) and not torch.allclose(sum(grads), 4 * expected)
    assert torch.allclose(sum(shares), mean.detach())  # the shares add up to the step's loss
