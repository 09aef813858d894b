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
    parser.add_argument("--rank", type=int)  # the live launcher's
    # RANK,STEP,MICRO_BATCH: that rank's forward of that micro-batch raises once, between two FSDP modules
    parser.add_argument("--raise-at")
    parser.add_argument("--dropout", type=float, default=0.1)
    # the loss of this data position multiplied by 10^4 every time it is fed (rollback mode's spike)
    parser.add_argument("--spike-at", type=int)
    # FIRST,END: data positions [FIRST, END) never fed (a step from FIRST on feeds its position + END - FIRST):
    # the reference of a run whose rollback skipped that window
    parser.add_argument("--skip-window")
    args, _ = parser.parse_known_args()
    mesh = trainguard.data_parallel_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(args.dropout), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    raise_at = tuple(int(part) for part in args.raise_at.split(",")) if args.raise_at else None
    armed, raised = [], []

    def raise_once(_module: torch.nn.Module, _inputs: tuple) -> None:
        if armed[0] and not raised:
            raised.append(True)
            raise RuntimeError("injected: the forward failed once")

    if raise_at is not None and raise_at[0] == args.rank:
        model[3].register_forward_pre_hook(raise_once)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(args.run_dir, model, optimizer, config=args.config, mesh=mesh)

    window = tuple(int(part) for part in args.skip_window.split(",")) if args.skip_window else None

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        armed[:] = [raise_at == (args.rank, step, micro_batch)]
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
