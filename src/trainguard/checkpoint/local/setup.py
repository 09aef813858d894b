"""The local tier inside the reference trainer: built from the config, and the wipe fault's hook."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.checkpoint.local.paths import node_of
from trainguard.checkpoint.local.tier import LocalTier
from trainguard.checkpoint.memory_tier import DEFAULT_MEMORY_DIR, MemoryTier, run_key
from trainguard.config.schema import RunConfig
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.topology.layout import MESH_DIMS, Layout
from trainguard.topology.replica_groups import device_mesh_replica_groups


def ranks_per_node(config: RunConfig, world_size: int) -> int:
    """``parallel.ranks_per_node``, else the launcher's ``LOCAL_WORLD_SIZE``, else one node."""
    per_node = config.parallel.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ConfigError(f"parallel.ranks_per_node={per_node} does not divide the world size {world_size}")
    return per_node


def build_local_tier(config: RunConfig, run_dir: Path, layout: Layout, model: torch.nn.Module, events: EventLog,
                     faults: FaultInjector, static_files: Callable[[Path], None] | None = None) -> LocalTier | None:
    """The rank's ``LocalTier`` when ``checkpoint.local_interval`` is set (collective), else None."""
    world_size = dist.get_world_size()
    if not config.checkpoint.local_interval:
        faults.check_nodes(None)
        return None
    faults.check_nodes(world_size // ranks_per_node(config, world_size))
    ckpt = config.checkpoint
    return _rank_tier(config, run_dir, layout, model, events, static_files, interval=ckpt.local_interval,
                      directory=ckpt.local_dir, keep_last=ckpt.local_keep_last, tier="local")


def build_memory_tier(config: RunConfig, run_dir: Path, layout: Layout, model: torch.nn.Module,
                      events: EventLog) -> MemoryTier | None:
    """The rank's ``MemoryTier`` when ``checkpoint.memory_interval`` is set (collective), else None."""
    ckpt = config.checkpoint
    if not ckpt.memory_interval:
        return None
    directory = (ckpt.memory_dir or DEFAULT_MEMORY_DIR).replace("{run}", run_key(run_dir))
    return MemoryTier(_rank_tier(config, run_dir, layout, model, events, None, interval=ckpt.memory_interval,
                                 directory=directory, keep_last=ckpt.memory_keep_last, tier="memory"))


def _rank_tier(config: RunConfig, run_dir: Path, layout: Layout, model: torch.nn.Module, events: EventLog,
               static_files: Callable[[Path], None] | None, *, interval: int, directory: str | None,
               keep_last: int, tier: str) -> LocalTier:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    return LocalTier(
        run_dir, rank=rank, world_size=world_size,
        groups=device_mesh_replica_groups(layout.shape, MESH_DIMS),
        layout={"kind": "device_mesh", "mesh_shape": list(layout.shape), "mesh_dim_names": list(MESH_DIMS)},
        local_dir=directory, ranks_per_node=ranks_per_node(config, world_size), interval=interval,
        keep_last=keep_last, model=model, events=events, process_group=dist.new_group(backend="gloo"),
        static_files=static_files, tier=tier,
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
