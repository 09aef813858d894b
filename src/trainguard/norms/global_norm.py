"""The true global gradient norm under any mix of FSDP2, HSDP and tensor parallel, in one all-reduce.

Each gradient element is stored on ``ranks_per_stage / shard_product`` ranks, where ``shard_product``
is the product of the mesh sizes along which its DTensor is sharded. Weighting every rank's local sum
of squares by the inverse of that copy count and summing over the world counts each element once,
whatever meshes the parameters live on (plain ``clip_grad_norm_`` refuses DTensors from different
meshes). Extra scalars (the loss) ride along in the same collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def _is_sharded(placement: Placement) -> bool:
    # FSDP2 over a tensor-parallel weight shards dim 0 twice and marks the outer split _StridedShard,
    # which is not a Shard subclass and answers is_shard() with False
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _local_and_weight(grad: torch.Tensor, ranks_per_stage: int) -> tuple[torch.Tensor, float]:
    if isinstance(grad, DTensor):
        shard_product = math.prod(
            grad.device_mesh.size(dim) for dim, placement in enumerate(grad.placements) if _is_sharded(placement)
        )
        return grad.to_local(), shard_product / ranks_per_stage
    return grad, 1.0 / ranks_per_stage


# (gradient, the L2 norm of its local part) pairs measured already (the SDC gradient points'): the
# pair holds the gradient, so its id cannot be reused by another tensor while the pair lives
KnownNorms = Sequence[tuple[torch.Tensor, torch.Tensor]]


def local_sq_sum(grads: Iterable[torch.Tensor], ranks_per_stage: int, device: torch.device,
                 known: KnownNorms = ()) -> torch.Tensor:
    """This rank's weighted share of the squared global norm, on ``device`` (NaN/Inf propagate).
    ``known``: local norms measured already, not read again (the same ``_foreach_norm`` values)."""
    found = {id(grad): (grad, norm) for grad, norm in known}
    norms, weights, missing = [], [], []
    for grad in grads:
        local, weight = _local_and_weight(grad, ranks_per_stage)
        if not local.numel():
            continue
        entry = found.get(id(grad))
        if entry is not None and entry[0] is grad:
            norms.append(entry[1])
        else:
            norms.append(None)
            missing.append((len(norms) - 1, local.detach()))
        weights.append(weight)
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    if missing:
        for (i, _), norm in zip(missing, torch._foreach_norm([local for _, local in missing])):
            norms[i] = norm
    weights = torch.tensor(weights, dtype=torch.float64, device=device)
    return (torch.stack([n.to(device, torch.float64) for n in norms]).square() * weights).sum()


def global_norm_and_sums(
    grads: list[torch.Tensor],
    extras: torch.Tensor,
    ranks_per_stage: int,
    group: dist.ProcessGroup | None = None,
    known: KnownNorms = (),
) -> tuple[float, list[float]]:
    """Returns (global L2 norm, world sum of each of ``extras``) from one all-reduce and one host sync."""
    device = extras.device
    buffer = torch.cat([local_sq_sum(grads, ranks_per_stage, device, known).reshape(1),
                        extras.to(torch.float64).reshape(-1)])
    if dist.is_initialized():
        dist.all_reduce(buffer, group=group)
    values = buffer.tolist()
    return math.sqrt(values[0]), values[1:]


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scales gradients in place so their global norm is at most ``max_norm``; returns the factor."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return 1.0
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(locals_, coef)
    return coef


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None,
    pipeline_stages: int = 1,
) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for any mix of FSDP2/HSDP/TP DTensors; returns the true norm.

    ``group`` (default: the world) spans every rank of the model. With pipelining, each rank passes
    its own stage's parameters and ``pipeline_stages`` (the pp degree): the stages' sums then add up
    in the same all-reduce, and every stage gets the norm of the whole model.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    if pipeline_stages < 1 or ranks % pipeline_stages:
        raise ValueError(f"pipeline_stages={pipeline_stages} does not divide the {ranks} ranks of the group")
    device = grads[0].device if grads else torch.device("cpu")
    norm, _ = global_norm_and_sums(grads, torch.zeros(0, device=device), ranks_per_stage=ranks // pipeline_stages,
                                   group=group)
    clip_grads_(grads, max_norm, norm)
    return norm
