"""The replica group's mesh a live rank shards its model over with ``fully_shard`` (FSDP2 inside a replica group).

A ``DeviceMesh`` is made over the default process group (``DeviceMesh.from_group`` refuses the
``ProcessGroupGloo`` backends each live epoch makes: ``TypeError: ... not iterable``, torch 2.13.0's
``device_mesh.py``), so each replica group's ranks make the group their default process group, as
torchft's ``ft_init_device_mesh`` does (each of its replica groups is a job of its own): a gloo group of
``group_size`` ranks on a ``PrefixStore`` of the run's store, one prefix per incarnation of the group.
FSDP2 never talks on it: every all-gather and reduce-scatter is routed to the live epoch's group
(``fsdp_comms``); the default group only gives the mesh its ranks.

An incarnation is one start of every rank of the group: a rank of a sharded group whose group leaves
the quorum ends its process (``layout_fsdp.GroupOut``) and is started again with its peer's replacement, so
that the new processes make a new default group together (as torchft restarts a whole replica group).
Each start of a rank raises its count in the store (``starts_key``); the ranks of one group started the
same number of times meet on the same prefix.

Warm spares come in spare groups of ``group_size``: spare ``s`` is position ``s % group_size`` of spare
group ``s // group_size``, whose ranks make their default group together as they start (a spare learns
its rank only when it replaces one, after its script sharded the model over this mesh). The launcher
hands a lost replica group's positions to one spare group, position for position
(``spare_choice.spare_for``), so that group's default group is the new one of the replica group it joins.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainguard.live.shards import shard_of

MESH_DIM = "dp_shard"  # the mesh's one dimension, as ``data_parallel_mesh`` names it under torchrun
TP_DIM = "tp"  # with tensor parallel, the mesh's second dimension (``parallel.tp``), as restart mode names it
RENDEZVOUS_S = 120.0  # a replacement waits this long for its group's other new processes

_made: list[DeviceMesh] = []  # this process's replica group mesh, made once
# with tensor parallel, the mesh's own groups by name, registered again after each swap of the default group
_kept: dict[str, dist.ProcessGroup] = {}


def starts_key(rank: int) -> str:
    return f"replica_mesh/starts/{rank}"


def default_group_prefix(group: int, incarnation: int) -> str:
    return f"replica_mesh/{group}/{incarnation}"


def spare_group_prefix(spare: int, group_size: int) -> str:
    return f"replica_mesh/spares/{spare // group_size}"


def replica_group_mesh(store_address: str, rank: int | None, group_size: int, spare: int | None = None,
                       tp: int = 1, tp_timeout_s: float = RENDEZVOUS_S) -> DeviceMesh:
    """The mesh of this rank's replica group, or of warm spare ``spare``'s spare group (``rank`` None): 1-D
    ``dp_shard``, or with tensor parallel (``tp`` > 1) 2-D ``(dp_shard, tp)``, tp fastest (``dp_shard`` may be
    1); made once per process, the default process group with it. Tensor parallel's collectives are not
    routed as FSDP2's are: they run on the mesh's ``tp`` group, whose waits end at ``tp_timeout_s``
    (``fault_tolerance.collective_timeout_s``): what a hung tp peer costs its group's other ranks at most."""
    if _made:
        return _made[0]
    host, port = store_address.rsplit(":", 1)
    timeout = timedelta(seconds=RENDEZVOUS_S)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    if rank is None:
        if spare is None:
            raise ValueError("replica_group_mesh: neither a rank nor a spare")
        prefix, position = spare_group_prefix(spare, group_size), spare % group_size
    else:
        prefix = default_group_prefix(rank // group_size, store.add(starts_key(rank), 1))
        position = shard_of(rank, group_size)
    if group_size % tp:
        raise ValueError(f"replica_group_mesh: tp={tp} does not divide the group's {group_size} ranks")
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=position, world_size=group_size,
                            timeout=timeout if tp == 1 else timedelta(seconds=tp_timeout_s))
    if tp == 1:
        _made.append(init_device_mesh("cpu", (group_size,), mesh_dim_names=(MESH_DIM,)))
    else:
        _made.append(_tensor_parallel_mesh(position, group_size // tp, tp, timedelta(seconds=tp_timeout_s)))
    return _made[0]


def is_replica_group_mesh(mesh: object) -> bool:
    """Whether ``mesh`` is the one ``replica_group_mesh`` made in this process, or its ``dp_shard`` dimension."""
    if not _made:
        return False
    made = _made[0]
    return mesh is made or (made.ndim == 2 and isinstance(mesh, DeviceMesh) and mesh == made[MESH_DIM])


def _tensor_parallel_mesh(position: int, shards: int, tp: int, timeout: timedelta) -> DeviceMesh:
    """The ``(shards, tp)`` mesh over the default group, each dimension a group of its own named by its ranks
    (``use_local_synchronization``: a hashed name). Not ``init_device_mesh``'s groups: a dimension spanning
    the default group is that group, whose name ("0") the durable tier's checkpoint group takes when it
    replaces it (tp's all-reduces would sum over the quorum, silently), and the others are named by a
    count that restarts then, so the checkpoint's own groups would take their names too."""
    layout = torch.arange(shards * tp).view(shards, tp)
    shard, tp_rank = divmod(position, tp)
    groups = [dist.new_group(layout[:, tp_rank].tolist(), timeout=timeout, use_local_synchronization=True),
              dist.new_group(layout[shard].tolist(), timeout=timeout, use_local_synchronization=True)]
    _kept.update((group.group_name, group) for group in groups)
    return DeviceMesh.from_group(groups, "cpu", layout, mesh_dim_names=(MESH_DIM, TP_DIM))


def keep_mesh_groups() -> None:
    """Registers the tensor-parallel mesh's groups again after ``dist.destroy_process_group()``, which the
    durable tier calls to replace this process's default group by its checkpoint group: it unregisters every
    group by name, where tensor parallel's collectives look theirs up, and shuts each down, which leaves a
    gloo group working (checked: test_live_tp.py's runs save every 2 steps and stay bitwise). Their names
    are hashes of their ranks (``_tensor_parallel_mesh``), which no counted name takes again."""
    for name, group in _kept.items():
        torch._C._distributed_c10d._register_process_group(name, group)
