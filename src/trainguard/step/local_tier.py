"""The local tier of a ``Guard``: built from the ``checkpoint`` section and the mesh, and the wipe fault's hook."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.local.paths import node_of
from trainguard.checkpoint.local.tier import LocalTier
from trainguard.checkpoint.memory_tier import DEFAULT_MEMORY_DIR, MemoryTier, run_key
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.topology.replica_groups import device_mesh_replica_groups


def resolve_ranks_per_node(configured: int | None, world_size: int) -> int:
    """``parallel.ranks_per_node``, else the launcher's ``LOCAL_WORLD_SIZE``, else one node."""
    per_node = configured or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ConfigError(f"parallel.ranks_per_node={per_node} does not divide the world size {world_size}")
    return per_node


def build_local_tier(run_dir: Path, config: CheckpointConfig, *, mesh_shape: Sequence[int],
                     mesh_dim_names: Sequence[str], ranks_per_node: int, model: torch.nn.Module, events: EventLog,
                     static_files: Callable[[Path], None] | None = None) -> LocalTier | None:
    """The rank's ``LocalTier`` when ``checkpoint.local_interval`` is set (collective), else None."""
    if not config.local_interval:
        return None
    return _rank_tier(run_dir, mesh_shape, mesh_dim_names, ranks_per_node, model, events, static_files,
                      interval=config.local_interval, directory=config.local_dir, keep_last=config.local_keep_last,
                      tier="local")


def build_memory_tier(run_dir: Path, config: CheckpointConfig, *, mesh_shape: Sequence[int],
                      mesh_dim_names: Sequence[str], ranks_per_node: int, model: torch.nn.Module,
                      events: EventLog) -> MemoryTier | None:
    """The rank's ``MemoryTier`` when ``checkpoint.memory_interval`` is set (collective), else None."""
    if not config.memory_interval:
        return None
    directory = (config.memory_dir or DEFAULT_MEMORY_DIR).replace("{run}", run_key(run_dir))
    return MemoryTier(_rank_tier(run_dir, mesh_shape, mesh_dim_names, ranks_per_node, model, events, None,
                                 interval=config.memory_interval, directory=directory,
                                 keep_last=config.memory_keep_last, tier="memory", recycle=True,
                                 tracker=False),
                      writer=config.writer,
                      busy_group=dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None)


def _rank_tier(run_dir: Path, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str], ranks_per_node: int,
               model: torch.nn.Module, events: EventLog, static_files: Callable[[Path], None] | None, *,
               interval: int, directory: str | None, keep_last: int, tier: str, recycle: bool = False,
               tracker: bool = True) -> LocalTier:
    return LocalTier(
        run_dir, rank=dist.get_rank(), world_size=dist.get_world_size(),
        groups=device_mesh_replica_groups(mesh_shape, mesh_dim_names),
        layout={"kind": "device_mesh", "mesh_shape": list(mesh_shape), "mesh_dim_names": list(mesh_dim_names)},
        local_dir=directory, ranks_per_node=ranks_per_node, interval=interval, keep_last=keep_last, model=model,
        events=events, process_group=dist.new_group(backend="gloo"), static_files=static_files, tier=tier,
        recycle=recycle, tracker=tracker,
    )


def fire_wipe_faults(faults: FaultInjector, tier: LocalTier, step: int) -> None:
    """Runs a due ``wipe`` with every rank held at barriers, so no rank is mid-write when its node's
    directory goes and none runs on before it is gone."""
    if not faults.wipe_due(step):
        return
    tier.wait()  # no retention thread may be deleting in a directory while it goes
    dist.barrier(group=tier.group)
    node = node_of(tier.rank, tier.ranks_per_node)
    node_ranks = [r for r in range(tier.world_size) if node_of(r, tier.ranks_per_node) == node]
    node_dirs = sorted({tier.rank_dirs[r] for r in node_ranks})
    faults.after_local_save(step, node, tier.rank == node_ranks[0], node_dirs)
    dist.barrier(group=tier.group)
