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

With tensor parallel inside each replica group (``parallel.tp`` > 1), ``trainguard.device_mesh(tp)`` is the
2-D ``(dp_shard, tp)`` mesh, the same call in both modes: under torchrun over the world, in live mode the
replica group's (``parallel.dp_shard × tp`` ranks, tp fastest; ``dp_shard`` may be 1). The script applies
``parallelize_module(..., mesh["tp"], ...)`` then ``fully_shard(..., mesh=mesh["dp_shard"])`` and passes
``Guard(..., mesh=mesh)``, as under torchrun; ``data_parallel_mesh()`` is then that ``dp_shard`` dimension.

A script with another layout (HSDP, PP) builds its mesh itself, as before.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainguard.errors import ConfigError
from trainguard.live.replica_mesh import MESH_DIM, TP_DIM, replica_group_mesh
from trainguard.live.worker import LiveArgs
from trainguard.step.live import started_by_live_launcher


def data_parallel_mesh(argv: list[str] | None = None) -> DeviceMesh | None:
    """The data-parallel mesh of this process (see the module docstring); ``argv`` default ``sys.argv[1:]``."""
    argv = sys.argv[1:] if argv is None else argv
    if started_by_live_launcher(argv):
        args = LiveArgs.parse(argv)
        if not args.fsdp:
            return None
        mesh = _live_mesh(args)
        return mesh if args.tp == 1 else mesh[MESH_DIM]
    return _torchrun_mesh((_default_group_size(),), (MESH_DIM,))


def device_mesh(tp: int, argv: list[str] | None = None) -> DeviceMesh:
    """The 2-D ``(dp_shard, tp)`` mesh of this process (see the module docstring); ``argv`` default
    ``sys.argv[1:]``. In live mode ``tp`` must be the run's ``parallel.tp`` (a ``ConfigError`` naming both)."""
    argv = sys.argv[1:] if argv is None else argv
    if started_by_live_launcher(argv):
        args = LiveArgs.parse(argv)
        if not args.fsdp or args.tp != tp:
            raise ConfigError(f"trainguard.device_mesh(tp={tp}): the live run has parallel.tp={args.tp if args.fsdp else 1}"
                              f"{'' if args.fsdp else ' and fault_tolerance.fsdp false'}; set parallel.tp={tp} and "
                              "fault_tolerance.fsdp: true")
        return _live_mesh(args)
    world = _default_group_size()
    if world % tp:
        raise ConfigError(f"trainguard.device_mesh(tp={tp}): tp does not divide the world of {world} ranks")
    return _torchrun_mesh((world // tp, tp), (MESH_DIM, TP_DIM))


def _live_mesh(args: LiveArgs) -> DeviceMesh:
    return replica_group_mesh(args.store, args.rank, args.group_size, args.spare, args.tp, args.collective_timeout_s)


def _default_group_size() -> int:
    """The world under torchrun: the default process group made if it is not yet."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size()


def _torchrun_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", shape, mesh_dim_names=names)
