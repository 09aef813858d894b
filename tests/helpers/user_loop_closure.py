"""tests/helpers/live_loop.py's training in the closure mode, one process: the same model, data, loss and
configuration file with ``fault_tolerance.live`` off, through the same loop (``guard.step(loss_of)``),
which accumulates each step's global batch (``train.micro_batches`` micro-batches) in micro-batch order
with the same per-micro-batch seeding, as live mode sums it. For comparing the two modes' guard verdicts
on the same gradients.

    python tests/helpers/user_loop_closure.py --config FILE --run-dir DIR [--set KEY=VALUE ...] [--one-cycle] [--seen]
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import trainguard
from trainguard.config import load_config

LIVE_LOOP = Path(__file__).resolve().parent / "live_loop.py"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--one-cycle", action="store_true")
    parser.add_argument("--seen", action="store_true")
    args = parser.parse_args(argv)
    loop = runpy.run_path(str(LIVE_LOOP))
    model = loop["build_model"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = load_config(args.config, ["fault_tolerance.live=false", *args.overrides])
    scheduler = loop["one_cycle"](optimizer, config.train.steps) if args.one_cycle else None
    seen = loop["StepsSeen"]() if args.seen else None
    guard = trainguard.Guard(args.run_dir, model, optimizer, scheduler, stateful={"seen": seen} if seen else None,
                             config=config, embedding=model[0].weight)

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        inputs, labels = loop["batch"](step, micro_batch, guard.micro_batches)
        return F.cross_entropy(model(inputs), labels)

    step = guard.resume()
    while not guard.should_stop(step, guard.config.train.steps):
        if seen is not None:
            seen.before(step)
        step = guard.step(loss_of).step
    return guard.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
