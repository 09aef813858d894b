"""A replica group's share of a live step computed with FSDP2 (``fully_shard`` over ``replica_mesh``'s mesh).

The share of group ``j`` is its slots' micro-batches (``group_reduce.SlotLayout``): the rank at position
``k`` runs slot ``(j, k)``'s micro-batches in sequence, FSDP2 accumulating their gradients unsharded
(``set_requires_gradient_sync`` off) and reduce-scattering the sum once, at the share's last micro-batch:
one reduce-scatter per share (``fsdp_comms``: summed in position order). What a rank keeps is its
``Shard(0)`` rows of the group's partial (``to_local()``: ``torch.chunk``'s rows, as ``sharded_params``'
layout), flat, with the share's loss after it. A survivor computing a lost group's share does the same at
the same positions, with the same parameters and random draws (``rng``), so its partial is bitwise the
lost group's. ``group_reduce.reduce_partials`` then adds the partials in group order.

A rank's micro-batches accumulate in sequence (FSDP2's own accumulation), not by ``tree_sum`` over
micro-batch indices as the row path does: so an FSDP2 run is bitwise equal to a run of the same layout
with or without failures, not to a run of another layout.

A share whose ``loss_of`` or backward raises on a rank (``fault_tolerance.max_step_failures``) leaves
FSDP2 mid-forward or mid-backward on every rank of the group: the failing rank tells the others at the
exchange they wait in (``fsdp_comms.GroupLink.fail_share``), every rank of the group resets FSDP2's
iteration state (``FSDPModule.reset_iter_state``: parameters resharded, the partial gradients dropped) and
raises ``ShareAbandoned``; the worker flags the step failed and the quorum computes it again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from trainguard.errors import ConfigError
from trainguard.live.fsdp_comms import GroupChannel, PeerShareFailed, route_to_epochs
from trainguard.live.group_reduce import tree_sum
from trainguard.live.micro_batch import MicroBatchLoss
from trainguard.live.rng import micro_batch_rng
from trainguard.live.step_failures import failure_text


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The model's FSDP2 modules (itself included), outermost first: empty for a model not sharded with
    ``fully_shard``."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _sharded_by_rows(placement: Placement) -> bool:
    """FSDP2's placement on the ``dp_shard`` dimension: ``Shard(0)``, or over a tensor-parallel split of
    dim 0 (``ColwiseParallel``'s) the strided ``_StridedShard(0)``, which is no ``Shard`` in torch 2.13."""
    return placement.is_shard(0) or getattr(placement, "dim", None) == 0


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShareAbandoned(Exception):
    """This rank's share of a step did not finish: its own ``loss_of`` or backward raised (``failure``: one
    line naming the error), or a peer's of its replica group did (``failure`` None). FSDP2's state is reset."""

    def __init__(self, failure: str | None):
        super().__init__(failure or "a peer of this replica group failed its share")
        self.failure = failure


class FsdpShares:
    """Computes a step's shares of ``model`` (sharded with ``fully_shard`` over this rank's replica group
    mesh of ``group_size`` ranks, ``(dp_shard, tp)`` with tensor parallel); its collectives go to ``channel()``
    (``fsdp_comms``), tensor parallel's to the mesh's own ``tp`` group."""

    def __init__(self, model: torch.nn.Module, modules: list[FSDPModule], rank: int, group_size: int,
                 channel: Callable[[], GroupChannel], tp: int = 1):
        self.model, self.modules = model, modules
        if not isinstance(model, FSDPModule):
            raise ConfigError("live recovery with an FSDP2 model: call fully_shard on the model itself too (its root "
                              "module), as FSDP2 expects; only submodules were sharded")
        self.params = list(model.parameters())
        for name, param in model.named_parameters():
            # with tensor parallel, a parameter tp does not split lies on the mesh's dp_shard dimension alone
            if not isinstance(param, DTensor) or param.device_mesh.size() not in (group_size, group_size // tp) \
                    or not _sharded_by_rows(param.placements[0]):
                raise ConfigError(f"live recovery with an FSDP2 model: parameter {name!r} is not sharded Shard(0) over "
                                  f"the replica group's mesh of {group_size} ranks (trainguard.data_parallel_mesh()); "
                                  "shard every parameter with fully_shard(module, mesh=mesh)")
            if param.dtype != torch.float32:
                raise ConfigError(f"live recovery's reduction carries float32: parameter {name!r} is {param.dtype}")
        self.link = route_to_epochs(modules, rank, group_size, channel, tp)
        self.grads: list[DTensor] | None = None  # ``set_grads``' gradients, made at its first call
        self.grad_shards: list[torch.Tensor] = []

    def local_numel(self) -> int:
        return sum(param.to_local().numel() for param in self.params)

    def share(self, loss_of: MicroBatchLoss, step: int, micro_batches: list[int], total_micro_batches: int,
              seed: int, beat: Callable[[], None], measured: Callable[[int], None] | None = None) -> torch.Tensor:
        """This rank's rows of the share of ``micro_batches`` (one slot's), its loss (the ``tree_sum`` of each
        micro-batch's share of the step's loss, a -0.0 made +0.0) last; the gradients are cleared after.
        ``measured(m)`` runs after micro-batch ``m``'s backward: FSDP2 accumulates the share's gradients,
        so what a micro-batch's own forward and backward measured (SDC's module points) is read there.
        ``ShareAbandoned`` when this rank's or a group peer's computation raised; a lost peer's error
        (a failed exchange) propagates: the epoch's recovery, not a retry, answers it."""
        losses = []
        self.model.zero_grad(set_to_none=True)
        self.link.collective_error = None
        try:
            for index, micro_batch in enumerate(micro_batches):
                beat()
                self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
                with micro_batch_rng(seed, step, micro_batch):
                    share = loss_of(self.model, step, micro_batch) / total_micro_batches
                    share.backward()
                losses.append(share.detach().reshape(1))
                if measured is not None:
                    measured(micro_batch)
        except PeerShareFailed as error:
            self.reset()
            raise ShareAbandoned(None) from error
        except Exception as error:  # the user's loss_of or its backward, unless an exchange failed
            if self.link.collective_error is not None:
                raise
            self.link.fail_share()
            self.reset()
            raise ShareAbandoned(failure_text(error)) from error
        rows = torch.cat([(local(param.grad) if param.grad is not None else torch.zeros_like(param.to_local()))
                          .reshape(-1) for param in self.params])
        self.model.zero_grad(set_to_none=True)
        return torch.cat([rows, tree_sum(losses)]) + 0.0

    def reset(self) -> None:
        """FSDP2 back to its state between steps after a share left mid-forward or mid-backward."""
        self.model.reset_iter_state()
        # reset_iter_state reshards but keeps the unsharded gradients FSDP2 accumulates with the gradient
        # sync off (the share's earlier micro-batches): a retry would add them in again. They are held by
        # FSDP2's own parameter objects only, so they are dropped there.
        for module in self.modules:
            for param_group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in param_group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        fsdp_param._unsharded_param.grad = None
                    fsdp_param.unsharded_accumulated_grad = None
        self.model.zero_grad(set_to_none=True)

    def set_grads(self, rows: torch.Tensor) -> None:
        """Each parameter's gradient: its rows of the step's summed gradient (this rank's flat shard), copied
        into DTensors made at the first call and kept (a DTensor made per parameter each step cost 6x the CPU
        of the copies, measured in one process on the example's model)."""
        if self.grads is None:
            self.grads = [DTensor.from_local(torch.empty_like(param.to_local()), param.device_mesh, param.placements,
                                             shape=param.shape, stride=param.stride()) for param in self.params]
            self.grad_shards = [grad.to_local() for grad in self.grads]  # the kept DTensors' own storage
        shards = self.grad_shards
        torch._foreach_copy_(shards, [part.view_as(shard) for part, shard in
                                      zip(rows.split([shard.numel() for shard in shards]), shards)])
        for param, grad in zip(self.params, self.grads):
            param.grad = grad
