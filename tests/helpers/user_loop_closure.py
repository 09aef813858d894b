"""examples/user_loop_live.py's training in the closure mode (``Guard.step(closure)``), one process: the
same model, data, dropout draws and configuration file with ``fault_tolerance.live`` off, each step's
global batch (``train.micro_batches`` micro-batches) summed by the live mode's fixed tree over micro-batch
indices (``live.group_reduce.tree_sum``). For comparing the two modes' guard verdicts on the same gradients.

    python tests/helpers/user_loop_closure.py --config FILE --run-dir DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import trainguard
from trainguard.live.group_reduce import tree_sum
from trainguard.live.rng import micro_batch_rng

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user_loop_live.py"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    example = runpy.run_path(str(EXAMPLE))
    model = example["build_model"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    guard = trainguard.Guard(args.run_dir, model, optimizer, config=args.config,
                             overrides=["fault_tolerance.live=false", *args.overrides])
    micro_batches, seed = guard.config.train.micro_batches, guard.config.train.seed
    step = guard.resume()
    while not guard.should_stop(step, guard.config.train.steps):
        def closure(data_step: int = step) -> torch.Tensor:  # the live mode's step index: counted from 0
            shares, grads = [], []
            for micro_batch in range(micro_batches):
                model.zero_grad(set_to_none=True)
                inputs, labels = example["batch"](data_step, micro_batch, micro_batches)
                with micro_batch_rng(seed, data_step, micro_batch):
                    share = F.cross_entropy(model(inputs), labels) / micro_batches
                    share.backward()
                shares.append(share.detach().reshape(1) + 0.0)  # a -0.0 made +0.0, as live mode does
                grads.append([param.grad + 0.0 for param in model.parameters()])
            for index, param in enumerate(model.parameters()):  # live mode's fixed tree over micro-batches
                param.grad = tree_sum([grad[index] for grad in grads])
            return tree_sum(shares)[0]

        step = guard.step(closure).step
    return guard.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
