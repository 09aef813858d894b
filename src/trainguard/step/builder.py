"""The builder of the closure mode's ``Guard``: every collaborator of the step, made from the config.

``build_guard_parts`` makes, in this order (each may depend on those before): the rank's logging, event
log and lifecycle; the fault injector (installed in the model before the SDC points, so that a point
sees a fault injected at its module); the local and memory tiers, the ``CheckpointManager`` and its
mirror; the SDC guard, the state guard (fingerprints), the skips, rollback mode and the embedding norm,
each registering the state it keeps in checkpoints. ``GuardParts`` hands them to ``Guard`` and to the
step skeleton (``step/skeleton.py``) as one typed bundle; nothing here runs a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.backup.attach import attach_mirror
from trainguard.checkpoint.manager import CheckpointManager, Stateful
from trainguard.config.schema import RunConfig
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.events.rank_logging import LOGGER_NAME, setup_logging
from trainguard.faults import FaultInjector
from trainguard.guards.plugins.sdc import SdcRerun
from trainguard.guards.plugins.update import update_plugins
from trainguard.guards.rollback import RollbackGuard
from trainguard.guards.sdc import sdc_config_from_env
from trainguard.guards.state_guard import StateGuard
from trainguard.guards.step_plugin import GuardPlugin
from trainguard.guards.step_skips import StepSkips
from trainguard.runtime.heartbeat import node_name
from trainguard.runtime.lifecycle import Lifecycle
from trainguard.step.embedding import EmbeddingNorm
from trainguard.step.local_tier import build_local_tier, build_memory_tier, resolve_ranks_per_node
from trainguard.step.plugins.sdc import ClosureSdcVotes
from trainguard.checkpoint.spike_rollback import SpikeRollback
from trainguard.step.plugins.state import StatePlugin
from trainguard.checkpoint.rollback import SkippableData, skippable_data
from trainguard.step.sdc import SdcGuard
from trainguard.step.static_files import huggingface_files
from trainguard.topology.rank_failure import raise_if_any_rank_failed
from trainguard.topology.replica_groups import device_mesh_replica_groups

FIND_EMBEDDING = "find"  # Guard(embedding=...) default: the model's input embedding, if it has one

# the names of the state the guard itself keeps in checkpoints, refused as names of a loop's stateful objects
OWN_STATEFUL_NAMES = frozenset({"scheduler", "skip_guard", "skip_streak", "rollback", "sdc_detector", "sdc_strikes"})


@dataclass
class GuardParts:
    """The collaborators of one rank's closure-mode ``Guard``."""

    run_dir: Path
    rank: int
    world_size: int
    ranks_per_stage: int  # ranks sharing one pipeline stage (all ranks without pp): the norm's and loss's weights
    host: str  # the supervisor's node name for simulated nodes, else the host name
    log: logging.Logger
    events: EventLog
    device: torch.device
    lifecycle: Lifecycle
    stateful: dict[str, Stateful]  # the loop's own objects (not the guard's state, which rides beside them)
    mesh: Any  # the data-parallel place of ``step(loss_of)``'s micro-batches
    faults: FaultInjector
    checkpoints: CheckpointManager
    sdc: SdcGuard | None  # guards.sdc on
    state: StateGuard
    skips: StepSkips
    rollback: RollbackGuard | None  # rollback mode (guards.check_for_global_norm)
    data: SkippableData | None  # rollback mode: the stateful object whose samples it skips
    embedding: EmbeddingNorm | None  # guards.monitor or guards.health on


@dataclass(frozen=True)
class StepPlugins:
    """The guards of the step skeleton, in the order they are asked, by phase."""

    before_backward: list[GuardPlugin]  # the state at rest, before any computation of the step
    integrity: list[GuardPlugin]  # after the all-reduce: whether the step's computation can be trusted
    update: list[GuardPlugin]  # then whether its update is applied, skipped or rolled back


def build_step_plugins(parts: GuardParts) -> StepPlugins:
    """The plugins of the guards ``parts`` holds. The order is the precedence (``guards/step_verdict.decide``):
    the state and SDC checks come first, so that the data skip judges the rerun's scalars; then the update's
    plugins as live mode asks them too (``guards/plugins/update.update_plugins``), rollback mode among them."""
    def state(before_backward: bool) -> StatePlugin:
        return StatePlugin(parts.state, parts.checkpoints, parts.events, parts.rank, parts.log,
                           before_backward=before_backward)

    integrity: list[GuardPlugin] = [state(before_backward=False)]
    if parts.sdc is not None:
        integrity.append(SdcRerun(ClosureSdcVotes(parts.sdc, parts.events, parts.rank, parts.world_size, parts.device)))
    rollback = None
    if parts.rollback is not None:
        data = parts.data
        rollback = SpikeRollback(
            parts.rollback, data, parts.checkpoints, parts.events,
            samples_of=lambda check: sum(b - a for a, b in data.ranges_between(check.first_sample, data.consumed_samples)),
            reports=lambda: parts.rank == 0)
    return StepPlugins([state(before_backward=True)], integrity, update_plugins(parts.skips, rollback))


def input_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            module = get()
        except (AttributeError, NotImplementedError):
            module = None
        if module is not None:
            return module.weight
    module = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return module.weight if module is not None else None


def replica_groups(mesh_shape: list[int], mesh_dim_names: list[str], world_size: int) -> list[tuple[int, ...]]:
    """The ranks holding the same parameter and optimizer shards (they differ in ``dp_replicate``
    alone); every rank alone when the mesh's dims are not the DeviceMesh names trainguard knows."""
    try:
        groups = device_mesh_replica_groups(mesh_shape, mesh_dim_names)
    except ValueError:
        return [(rank,) for rank in range(world_size)]
    return sorted({tuple(groups.full_replicas(rank)) for rank in range(world_size)})


def device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def build_guard_parts(
    run_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    stateful: Mapping[str, Stateful] | None,
    cfg: RunConfig,
    *,
    mesh: Any,
    pipeline_stages: int,
    embedding: torch.nn.Parameter | None | str,
    hf_config: Any,
    tokenizer: Any,
    tokens_per_step: int | None,
) -> GuardParts:
    """Every collaborator of the step from ``cfg`` (see the module docstring); a configuration mistake
    raises a ``ConfigError`` (every rank alike, where one rank alone can see it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if pipeline_stages < 1 or world_size % pipeline_stages:
        raise ValueError(f"pipeline_stages={pipeline_stages} does not divide the world size {world_size}")
    host = node_name()
    log = logging.getLogger(LOGGER_NAME)
    if not log.handlers:  # a loop that set up its own logging keeps it
        setup_logging(rank, run_dir / "logs")
    events = EventLog(run_dir / "events.jsonl", rank=rank, host=host)
    device = device_of(model)
    lifecycle = Lifecycle.for_rank(cfg.lifecycle, run_dir, rank, device)

    own_stateful = dict(stateful or {})
    reserved = OWN_STATEFUL_NAMES & set(own_stateful)
    if reserved:
        raise ValueError(f"stateful names {sorted(reserved)} are the guard's own; choose other names")
    rank_tiers = cfg.checkpoint.local_interval or cfg.checkpoint.memory_interval
    per_node = resolve_ranks_per_node(cfg.parallel.ranks_per_node, world_size) if rank_tiers else 1
    failure = None
    try:  # a fault naming a module of another pipeline stage fails on some ranks only
        faults = FaultInjector.from_env(run_dir, rank, world_size, events.emit, config_text=cfg.faults)
        faults.install(model)
        faults.check_nodes(world_size // per_node if cfg.checkpoint.local_interval else None)
    except ConfigError as exc:
        failure = exc
    raise_if_any_rank_failed(failure)
    mesh_shape = list(mesh.shape) if mesh is not None else [world_size]
    mesh_dim_names = list(mesh.mesh_dim_names) if mesh is not None else ["dp_shard"]
    static_files = huggingface_files(hf_config, tokenizer) if hf_config is not None else None
    local = None
    if cfg.checkpoint.local_interval:
        local = build_local_tier(run_dir, cfg.checkpoint, mesh_shape=mesh_shape, mesh_dim_names=mesh_dim_names,
                                 ranks_per_node=per_node, model=model, events=events, static_files=static_files)
    memory = None
    if cfg.checkpoint.memory_interval:
        memory = build_memory_tier(run_dir, cfg.checkpoint, mesh_shape=mesh_shape, mesh_dim_names=mesh_dim_names,
                                   model=model, events=events, ranks_per_node=per_node)
    managed: dict[str, Stateful] = {"scheduler": scheduler} if scheduler is not None else {}
    managed.update(own_stateful)
    checkpoints = CheckpointManager(
        run_dir, model, optimizer, managed, cfg.checkpoint, mesh_shape=mesh_shape, mesh_dim_names=mesh_dim_names,
        static_files=static_files, events=events, after_commit=faults.after_commit, seed=cfg.train.seed,
        local=local, memory=memory,
    )
    attach_mirror(checkpoints)
    sdc_config = sdc_config_from_env(cfg.guards.sdc)
    sdc: SdcGuard | None = None
    strike = None
    if sdc_config.enabled:  # installed after the faults, so a point sees a fault injected at its module
        sdc = SdcGuard(sdc_config, model, cfg.train.micro_batches, device, rank, host, log, events)
        checkpoints.stateful.update(sdc.stateful)
        # a fingerprint mismatch attributed to this rank: a strike against its device
        strike = functools.partial(sdc.strikes.record, rank, host, sdc.device_label)
    state = StateGuard(cfg.guards.fingerprint, model, optimizer, replica_groups(mesh_shape, mesh_dim_names, world_size),
                       rank, log, events.emit, strike=strike)
    skips = StepSkips(cfg.guards.skip, cfg.guards.max_consecutive_skips, log, events.emit,
                      reports=lambda: rank == 0, tokens_per_step=tokens_per_step)
    checkpoints.stateful.update(skips.stateful)
    rollback: RollbackGuard | None = None
    data: SkippableData | None = None
    if cfg.guards.check_for_global_norm:
        data = skippable_data(own_stateful)
        rollback = RollbackGuard(cfg.guards.rollback, cfg.guards.skip)
        checkpoints.stateful["rollback"] = rollback
    embedding_norm: EmbeddingNorm | None = None
    if cfg.guards.monitor or cfg.guards.health.enabled:
        weight = input_embedding(model) if isinstance(embedding, str) else embedding
        embedding_norm = EmbeddingNorm(weight, device)

    if getattr(model, "reducer", None) is not None and not (model.find_unused_parameters or model.static_graph):
        # a DistributedDataParallel that rebuilds its buckets at its first step (docs/library.md)
        log.warning("DDP rebuilds its gradient buckets at each process's first step: the first step after a "
                    "resume sums gradients in another order than a run that never stopped (a difference in "
                    "the last digits); DDP(..., find_unused_parameters=True) keeps the initial buckets and "
                    "resumes bitwise")
    return GuardParts(run_dir=run_dir, rank=rank, world_size=world_size, ranks_per_stage=world_size // pipeline_stages,
                      host=host, log=log, events=events, device=device, lifecycle=lifecycle, stateful=own_stateful,
                      mesh=mesh, faults=faults, checkpoints=checkpoints, sdc=sdc, state=state, skips=skips,
                      rollback=rollback, data=data, embedding=embedding_norm)
