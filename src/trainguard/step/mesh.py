"""``trainguard.data_parallel_mesh()``: the mesh a script shards its model over, the same call in both modes.

A script that runs under ``torchrun`` (restart mode) and under the live launcher (``fault_tolerance.live:
true``) with no code change cannot call ``init_process_group`` itself: a live rank has no default group
(each epoch's quorum makes its own, ``live/collective.py``). So it asks here, before it builds its model:

- started by ``torchrun`` (or any launcher that sets its environment): the default process group (nccl
  on CUDA, gloo on CPU), made if it is not yet, and one ``dp_shard`` dimension over the world, for
  ``fully_shard(module, mesh=mesh)`` and ``Guard(..., mesh=mesh)``;
- started by the live launcher (its ``--store`` flag among the arguments, as ``Guard`` checks it): with
  ``fault_tolerance.fsdp: true`` (the launcher's ``--fsdp``; it needs ``parallel.dp_shard`` > 1) the replica
  group's 1-D ``dp_shard`` mesh (``live/replica_mesh.py``: the group made this process's default group),
  for ``fully_shard(module, mesh=mesh)`` and ``Guard(..., mesh=mesh)`` as under torchrun; the live engine
  then computes each group's share with FSDP2 (``live/fsdp_share.py``). Otherwise None: the model stays
  whole, and with ``dp_shard`` > 1 live mode shards its parameters by rows itself (``live/sharded_params.py``).

A script with its own layout (HSDP, TP, PP) builds its mesh itself, as before.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainguard.live.replica_mesh import replica_group_mesh
from trainguard.live.worker import LiveArgs
from trainguard.step.live import started_by_live_launcher


def data_parallel_mesh(argv: list[str] | None = None) -> DeviceMesh | None:
    """The data-parallel mesh of this process (see the module docstring); ``argv`` default ``sys.argv[1:]``."""
    argv = sys.argv[1:] if argv is None else argv
    if started_by_live_launcher(argv):
        args = LiveArgs.parse(argv)
        return replica_group_mesh(args.store, args.rank, args.group_size, args.spare) if args.fsdp else None
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
