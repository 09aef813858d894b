"""Per-parameter local gradient norms: the norm of the shard each rank holds (the reference's local_norm)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def local_grad_norms(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, float]:
    """Each parameter's local gradient norm on this rank, in one host sync; NaN/Inf propagate."""
    names, locals_ = [], []
    for name, param in named_parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.numel():
            names.append(name)
            locals_.append(local.detach())
    if not locals_:
        return {}
    return dict(zip(names, torch.stack(torch._foreach_norm(locals_)).tolist()))
