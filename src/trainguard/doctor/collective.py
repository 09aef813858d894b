"""Collective sanity check across the node's local ranks: known values through all_reduce, broadcast and
all_gather, compared exactly (small integers are exact in float32 whatever the reduction order)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trainguard.doctor.report import CheckResult

_LENGTH = 1024


def _values(rank: int) -> torch.Tensor:
    return (torch.arange(_LENGTH, dtype=torch.float32) % 97 + 1) * (rank + 1)


def check_collectives(rank: int, world_size: int, device: torch.device) -> CheckResult:
    """Runs in every local rank after ``init_process_group``; the result is this rank's view."""
    started = time.perf_counter()
    problems = []
    base = torch.arange(_LENGTH, dtype=torch.float32) % 97 + 1

    reduced = _values(rank).to(device)
    dist.all_reduce(reduced)
    expected = base * (world_size * (world_size + 1) // 2)
    if not torch.equal(reduced.cpu(), expected):
        problems.append(f"all_reduce: {int((reduced.cpu() != expected).sum())} of {_LENGTH} values wrong")

    sent = (base * 7 if rank == 0 else torch.zeros(_LENGTH)).to(device)
    dist.broadcast(sent, src=0)
    if not torch.equal(sent.cpu(), base * 7):
        problems.append(f"broadcast: {int((sent.cpu() != base * 7).sum())} of {_LENGTH} values wrong")

    gathered = [torch.zeros(_LENGTH, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, _values(rank).to(device))
    wrong = [r for r, t in enumerate(gathered) if not torch.equal(t.cpu(), base * (r + 1))]
    if wrong:
        problems.append(f"all_gather: wrong values from rank(s) {wrong}")
    dist.barrier()
    backend = dist.get_backend()
    detail = "; ".join(problems) or f"all_reduce, broadcast, all_gather over {world_size} rank(s) ({backend}): exact"
    return CheckResult("collective", f"rank {rank}", not problems, detail, time.perf_counter() - started)
