"""Test fixture: ``world`` ranks (gloo, CPU) that are full replicas of one small model (every rank
trains on the same batches: bitwise-identical updates, as data-parallel replicas after their
all-reduce) under the StateGuard, with the faults of ``--faults``; each rank writes its final
parameters and optimizer state, the fingerprint verdicts and its strikes to ``OUT/rank<r>.pt``.

    python tests/helpers/replica_worker.py --rank R --world W --store FILE --out DIR --steps N --interval K [--faults TEXT]

``train_replica(steps, on_step)`` is the loop itself, also run in the test process for the fault-free
reference.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_replica(steps: int, model, optimizer, before=None, after=None) -> None:
    for step in range(1, steps + 1):
        if before is not None:
            before(step)
        generator = torch.Generator().manual_seed(step)
        inputs, target = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        torch.nn.functional.mse_loss(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after is not None:
            after(step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    for key in ("--rank", "--world", "--steps", "--interval"):
        parser.add_argument(key, type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--faults", default="")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from trainguard.faults import FaultInjector, parse_faults
    from trainguard.guards.fingerprint import FingerprintConfig
    from trainguard.guards.state_guard import StateGuard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    out = Path(args.out)
    model, optimizer = build()
    events: list[dict] = []
    strikes: list[dict] = []
    faults = FaultInjector(parse_faults(args.faults), out, args.rank, args.world,
                           lambda kind, step=None, **fields: events.append({"kind": kind, "step": step, **fields}))
    faults.install(model)
    guard = StateGuard(FingerprintConfig(interval=args.interval), model, optimizer, [tuple(range(args.world))],
                       args.rank, logging.getLogger("replica"),
                       lambda kind, step=None, **fields: events.append({"kind": kind, "step": step, **fields}),
                       strike=lambda step, evidence: strikes.append({"step": step, **evidence}) or False)

    def before(step: int) -> None:
        faults.at_rest(step, model, optimizer)
        guard.before_step(step)

    train_replica(args.steps, model, optimizer, before, guard.after_update)
    health = guard.before_save(args.steps)
    state = {f"param:{name}": p.detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            state[f"{key}:{name}"] = value.clone()
    torch.save({"state": state, "events": events, "strikes": strikes, "health": health}, out / f"rank{args.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
