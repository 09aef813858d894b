"""A tiny tensor-parallel training loop for test_live_tp.py: an MLP block split with ``ColwiseParallel`` /
``RowwiseParallel`` over ``trainguard.device_mesh(tp)["tp"]``, every layer sharded with ``fully_shard`` over
its ``dp_shard`` dimension, trained through ``Guard.step(loss_of)``; the same file as a restart-mode loop
under torchrun would be (live mode comes from the configuration alone)."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import trainguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)  # a wider window for a test's kill; no math
    parser.add_argument("--rank", type=int)  # the live launcher's
    parser.add_argument("--dropout", type=float, default=0.1)
    # the loss of this data position multiplied by 10^4 every time it is fed (rollback mode's spike)
    parser.add_argument("--spike-at", type=int)
    # FIRST,END: data positions [FIRST, END) never fed (a step from FIRST on feeds its position + END - FIRST):
    # the reference of a run whose rollback skipped that window
    parser.add_argument("--skip-window")
    args, _ = parser.parse_known_args()
    mesh = trainguard.device_mesh(args.tp)
    torch.manual_seed(0)
    # 0 column-wise (its output's columns split over tp), 2 row-wise (its input's): one all-reduce in the forward
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                                torch.nn.Dropout(args.dropout), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(args.run_dir, model, optimizer, config=args.config, mesh=mesh)

    window = tuple(int(part) for part in args.skip_window.split(",")) if args.skip_window else None

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        position = step + window[1] - window[0] if window is not None and step >= window[0] else step
        g = torch.Generator().manual_seed(1000 * position + micro_batch)
        inputs, targets = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        loss = F.mse_loss(model(inputs), targets)
        return loss * 1e4 if position == args.spike_at else loss

    step = guard.resume()
    while not guard.should_stop(step, args.steps):
        outcome = guard.step(loss_of)
        step = outcome.step
        if outcome.rolled_back:
            print(f"rank {args.rank}: rolled back to step {step}", flush=True)
        time.sleep(args.step_sleep)
    raise SystemExit(guard.close())


if __name__ == "__main__":
    main()
