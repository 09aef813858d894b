"""Applies tensor parallel (Llama layout) and FSDP2 / HSDP (any supported model type) to a Hugging Face causal LM."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainguard.errors import ConfigError
from trainguard.hf.model_types import check_parallel_support
from trainguard.trainer.gradient_average import ensure_gradient_average
from trainguard.topology.layout import MESH_DIMS, Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for HSDP, else 1-D."""
    if layout.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM: the one ``ModuleList`` of its base model
    (``model.layers`` for Llama, Qwen2, Mistral; ``transformer.h`` for GPT-2)."""
    lists = [child for child in model.base_model.children() if isinstance(child, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(f"{type(model).__name__}: cannot tell its decoder blocks ({len(lists)} module lists "
                          f"in {type(model.base_model).__name__})")
    return lists[0]


_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    cfg = model.config
    tp = tp_mesh.size()
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ConfigError(f"impossible parallel layout: model {name}={getattr(cfg, name)} is not divisible by tp={tp}")
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {name: style() for name, style in _TP_PLAN.items()})


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, layout: Layout) -> torch.nn.Module:
    # the layout as resolved (a degree left unset may have become tp > 1); checked before start when set
    check_parallel_support(model.config.model_type, {"tp": layout.tp})
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    dp_mesh = data_parallel_mesh(mesh, layout)
    shard_blocks(model, dp_mesh)
    ensure_gradient_average(model, dp_mesh)
    return model


def shard_blocks(model: torch.nn.Module, dp_mesh: DeviceMesh) -> torch.nn.Module:
    """FSDP2 over ``dp_mesh``: each decoder block its own unit, then the root, which holds the embeddings,
    the final norm and the output layer (tied to the input embedding or not: one parameter either way,
    so sharded once). Restart mode's layout and live mode's (``trainer/live.py``, over the replica group's
    mesh) are this one."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
