"""FSDP2 averages gradients over its data-parallel ranks by asking the backend for ``ReduceOp.AVG``;
gloo under torch 2.8 sums instead (a 2-way run logs exactly twice the true gradient norm, and clipping
and the guards' thresholds act on that). Whether this backend averages is probed once, with the two
collectives FSDP2 uses; where it does not, FSDP2 is switched to a plain sum divided by the
data-parallel size afterwards (``FSDPModule.set_force_sum_reduction_for_comms``, public since 2.8)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


# the collective FSDP2 issues: ``reduce_scatter_single`` from torch 2.13 (``reduce_scatter_tensor``, its
# name before, warns there that it is deprecated)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_averages(group: dist.ProcessGroup) -> bool:
    """Whether ``ReduceOp.AVG`` averages on ``group`` for both collectives FSDP2 issues (reduce-scatter
    over the shard dimension, all-reduce over the replicate one); collective over ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return True
    contribution = float(dist.get_rank(group) + 1)
    mean = (size + 1) / 2
    try:
        reduced = torch.empty(1)
        reduce_scatter(reduced, torch.full((size,), contribution), op=dist.ReduceOp.AVG, group=group)
        summed = torch.full((1,), contribution)
        dist.all_reduce(summed, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):  # a backend that refuses AVG outright
        return False
    return reduced.item() == mean and summed.item() == mean


def ensure_gradient_average(model: torch.nn.Module, dp_mesh: DeviceMesh, *, force: bool = False) -> bool:
    """Makes every FSDP2 module of ``model`` average its gradients over ``dp_mesh`` where the backend's
    ``AVG`` does not (or always, with ``force``); returns whether it switched them. Collective over
    ``dp_mesh``: every rank probes, so every rank decides alike."""
    averages = all([backend_averages(dp_mesh.get_group(dim)) for dim in range(dp_mesh.ndim)])
    if averages and not force:
        return False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return True
