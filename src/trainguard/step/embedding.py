"""The embedding's local gradient norm: measured before clipping, its max over ranks only at a save.

The reference's checkpoint health rule compares the embedding local norm of every rank holding the
embedding with ``embedding_local_norm_threshold``; a checkpoint saved while any rank is above it (or
NaN/Inf) is unhealthy. Each rank keeps its own value of the last step; the max over ranks costs one
small all-reduce, spent only when a checkpoint of that step is written.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainguard.guards.health import HealthConfig, save_health


class EmbeddingNorm:
    """``weight``: this rank's embedding parameter, None on ranks without it (later pipeline stages)."""

    def __init__(self, weight: torch.nn.Parameter | None, device: torch.device):
        self.weight = weight
        self.device = device
        self._local: torch.Tensor | None = None

    def measure(self) -> None:
        """Takes this rank's local norm of the current gradient (call it before clipping)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        grad = self.weight.grad if self.weight is not None else None
        if grad is None:
            self._local = zero
            return
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        self._local = local.detach().double().norm().to(self.device)

    def forget(self) -> None:
        """No step measured since (a rollback, a resume): nothing to judge a save by."""
        self._local = None

    def local(self) -> float | None:
        """This rank's value of the last step (None when nothing is measured)."""
        return None if self._local is None else float(self._local)

    def health(self, config: HealthConfig) -> dict | None:
        """The health record of a save of the last step (collective); None when not monitored."""
        if not config.enabled or self._local is None:
            return None
        return save_health(config, max_over_ranks(self._local))


def max_over_ranks(value: torch.Tensor) -> float:
    """The largest of every rank's value; NaN when any rank's is NaN (a NaN is worse than any number)."""
    nan = torch.isnan(value)
    pair = torch.stack([torch.where(nan, torch.full_like(value, math.inf), value), nan.double()])
    if dist.is_initialized():
        dist.all_reduce(pair, op=dist.ReduceOp.MAX)
    largest, any_nan = pair.tolist()
    return math.nan if any_nan else largest
