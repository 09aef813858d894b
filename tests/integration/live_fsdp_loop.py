"""A tiny FSDP2 training loop for test_live_fsdp.py: the model sharded with ``fully_shard`` over
``trainguard.data_parallel_mesh()``, trained through ``Guard.step(loss_of)``; the same file as a restart-mode
loop would be (live mode comes from the configuration alone)."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import trainguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0)  # a wider window for a test's kill; no math
    args, _ = parser.parse_known_args()
    mesh = trainguard.data_parallel_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(args.run_dir, model, optimizer, config=args.config, mesh=mesh)

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + micro_batch)
        inputs, targets = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        return F.mse_loss(model(inputs), targets)

    step = guard.resume()
    while not guard.should_stop(step, args.steps):
        step = guard.step(loss_of).step
        time.sleep(args.step_sleep)
    raise SystemExit(guard.close())


if __name__ == "__main__":
    main()
