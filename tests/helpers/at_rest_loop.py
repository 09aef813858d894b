"""A one-process loop on trainguard.Guard for the every-step at-rest check: a tiny linear model, AdamW,
sample positions from the reference trainer's ``StatefulSampler`` (rollback mode skips ranges of them).

    python at_rest_loop.py RUN_DIR STEPS [--flip-after skipped|rolled_back] [--set section.key=value ...]

``--flip-after``: right after the first step outcome of that kind, the loop flips one bit of the
weight, at rest, as failing memory would. Faults (a spike) come from ``TRAINGUARD_FAULTS``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import trainguard
from trainguard.config import load_config
from trainguard.faults.bits import flip_bit
from trainguard.trainer.data import StatefulSampler

SAMPLES = 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--flip-after", choices=("skipped", "rolled_back"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = StatefulSampler(SAMPLES, dp_rank=0, dp_size=1, micro_batch_size=4, seed=0)
    inputs = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    guard = trainguard.Guard(args.run_dir, model, optimizer, stateful={"data": data},
                             config=load_config(None, args.overrides))
    step = guard.resume()
    flip_due = args.flip_after is not None
    while not guard.should_stop(step, args.steps):
        def closure() -> torch.Tensor:
            batch = inputs[data.next_batch_indices()]
            loss = (model(batch) - batch).square().mean()
            loss.backward()
            return loss

        outcome = guard.step(closure)
        step = outcome.step
        if flip_due and getattr(outcome, args.flip_after):
            flip_bit(model.weight.detach().view(-1), 3)
            flip_due = False
    raise SystemExit(guard.close())


if __name__ == "__main__":
    main()
