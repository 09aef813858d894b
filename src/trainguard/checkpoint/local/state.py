"""A rank's model and optimizer state as plain local tensors, and back; the model's tensors as the
DTensors verl's checkpoint manager writes (what verl's own merger reads); the ``fsdp_config.json`` that
says how the local tensors fit together over the whole mesh (what trainguard's merger reads)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainguard.checkpoint.state_dict import STATE_DICT_OPTIONS


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.detach() if isinstance(value, torch.Tensor) else value


def _plain(value: Any) -> Any:
    value = _local(value)
    return value.to("cpu").contiguous() if isinstance(value, torch.Tensor) else value


def local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``local_state`` with each tensor where it lives (the rank's shard, not copied): what the memory
    tier stages, in the background, into CPU buffers."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    return {k: _local(v) for k, v in model_sd.items()}, {k: _local(v) for k, v in optim_sd.items()}


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model, optimizer)`` state of this rank: ``{fqn: local tensor}`` and the optimizer state
    flattened with the durable tier's keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), as
    plain contiguous CPU tensors."""
    model_sd, optim_sd = local_tensors(model, optimizer)
    return {k: _plain(v) for k, v in model_sd.items()}, {k: _plain(v) for k, v in optim_sd.items()}


VERL_DIM_NAMES = {"dp_replicate": "ddp", "dp_shard": "fsdp"}
"""verl's FSDP workers name their mesh ``("fsdp",)`` or ``("ddp", "fsdp")``, and its merger accepts
only those names; the other dims (``tp``, ``pp``) keep theirs (verl's merger does not merge them)."""


@dataclass(frozen=True)
class DTensorLayout:
    """How one parameter's local shard is written as a DTensor: mesh, placements, global shape, stride."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def dtensor_layouts(model: torch.nn.Module, as_rank: int) -> dict[str, DTensorLayout]:
    """``fqn -> DTensorLayout`` of each DTensor parameter (a tied weight under each name): the
    parameter's own (sub)mesh and placements, the mesh renamed to verl's dim names and built without
    process groups (it is only pickled: a reader needs its ranks and names, never its groups). A pickled
    mesh records a rank: ``as_rank``, the lowest of this rank's model replica group, so that replicas'
    files stay byte-identical (a lost file is restored by copying a replica's)."""
    meshes: dict[int, DeviceMesh] = {}
    layouts = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        if id(mesh) not in meshes:
            names = tuple(VERL_DIM_NAMES.get(name, name) for name in mesh.mesh_dim_names or ())
            meshes[id(mesh)] = mesh_as_seen_by(mesh.mesh.cpu(), names or None, as_rank)
        layouts[fqn] = DTensorLayout(meshes[id(mesh)], tuple(param.placements), param.shape, param.stride())
    return layouts


MESH_TAKES_RANK = "_rank" in inspect.signature(DeviceMesh.__init__).parameters
"""Whether ``DeviceMesh`` takes the rank it is built for (torch 2.10 on); before, it records the
calling process's own rank."""


def mesh_as_seen_by(ranks: torch.Tensor, dim_names: tuple[str, ...] | None, rank: int) -> DeviceMesh:
    """A CPU ``DeviceMesh`` of ``ranks`` without process groups, recording ``rank``'s coordinates (not the
    caller's), so that the pickles of replicas are byte-identical. ``DeviceMesh``'s ``_rank`` keyword is
    private and absent before torch 2.10; there, the mesh built for the caller gets ``rank``'s
    coordinates in the attribute that torch's own constructor fills."""
    if MESH_TAKES_RANK:
        return DeviceMesh("cpu", ranks, mesh_dim_names=dim_names, _init_backend=False, _rank=rank)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=dim_names, _init_backend=False)
    found = (ranks == rank).nonzero()
    mesh._coordinate_on_dim = found[0].tolist() if found.size(0) else None
    return mesh


def as_dtensors(state: dict[str, Any], layouts: dict[str, DTensorLayout]) -> dict[str, Any]:
    """Each local CPU tensor of ``state`` that is a DTensor parameter's shard, wrapped as that DTensor
    (the bytes are the same tensor's: nothing is copied); buffers and other values as they are."""
    wrapped = {}
    for key, value in state.items():
        layout = layouts.get(key)
        if layout is not None and isinstance(value, torch.Tensor):
            value = DTensor.from_local(value, layout.mesh, layout.placements, run_check=False,
                                       shape=layout.shape, stride=layout.stride)
        wrapped[key] = value
    return wrapped


def _like(template: Any, loaded: Any, key: str) -> Any:
    if isinstance(loaded, DTensor):  # the local tier's model files (see as_dtensors)
        loaded = loaded.to_local()
    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(loaded, torch.Tensor) or loaded.shape != local.shape:
            raise ValueError(f"{key}: local shape {tuple(getattr(loaded, 'shape', ()))} != {tuple(local.shape)}")
        return DTensor.from_local(loaded.to(local.device, local.dtype), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, torch.Tensor):
        return loaded.to(template.device)
    return loaded


def load_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Puts this rank's local tensors back into the model and the optimizer (same layout as saved)."""
    model_template, optim_template = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    for name, template, loaded in (("model", model_template, model_sd), ("optimizer", optim_template, optim_sd)):
        missing = sorted(set(template) - set(loaded))
        if missing:
            raise ValueError(f"{name} state lacks {missing[0]!r}")
    model_state = {k: _like(v, model_sd[k], k) for k, v in model_template.items()}
    optim_state = {k: _like(v, optim_sd[k], k) for k, v in optim_template.items()}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=STATE_DICT_OPTIONS)


def placement_name(placement: Any) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial()``, ``_StridedShard(0, sf=2)``."""
    kind = type(placement).__name__
    if kind == "_StridedShard":
        return f"_StridedShard({placement.dim}, sf={placement.split_factor})"
    if kind == "Shard":
        return f"Shard({placement.dim})"
    return f"{kind}()"


def param_layout(model: torch.nn.Module, mesh_dim_names: list[str]) -> dict[str, dict[str, Any]]:
    """``fqn -> {shape, dtype, placements}``; placements per dim of the whole mesh, in mesh order
    (``Replicate()`` for a dim the parameter's mesh does not use)."""
    params = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):  # a tied weight is in the state dict twice
        placements = ["Replicate()"] * len(mesh_dim_names)
        if isinstance(param, DTensor):
            for dim_name, placement in zip(param.device_mesh.mesh_dim_names or (), param.placements):
                placements[mesh_dim_names.index(dim_name)] = placement_name(placement)
        params[fqn] = {"shape": list(param.shape), "dtype": str(param.dtype).removeprefix("torch."),
                       "placements": placements}
    return params
