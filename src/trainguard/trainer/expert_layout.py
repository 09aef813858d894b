"""Which parallel layouts the reference trainer runs a mixture-of-experts model (Mixtral, Qwen2-MoE) on.

transformers keeps their experts as fused 3-D parameters (``hf.fused_experts``): FSDP2 / HSDP shard
them along dim 0, the expert dimension, so each rank holds whole experts when the number of experts
(Mixtral's ``num_local_experts``, Qwen2-MoE's ``num_experts``) divides by ``parallel.dp_shard``
(checked, so that a rank's shard never cuts an expert in two). Pipeline stages hold whole layers and
need nothing more. Tensor parallel is refused with the other layouts a model type cannot take
(``hf.model_types.UNSUPPORTED_PARALLEL``).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from trainguard.errors import ConfigError
from trainguard.hf.fused_experts import expert_count_key
from trainguard.topology.layout import Layout


def check_expert_layout(model_config: PretrainedConfig, layout: Layout) -> None:
    """Raises ``ConfigError`` (one line naming the key and the model type) for a layout the trainer
    cannot run a model with fused experts on; nothing for other models."""
    model_type = model_config.model_type
    count_key = expert_count_key(model_type)
    if count_key is None:
        return
    experts = getattr(model_config, count_key)
    if experts % layout.dp_shard:
        raise ConfigError(f"parallel.dp_shard={layout.dp_shard}: model_type {model_type!r} has {count_key}="
                          f"{experts}, which FSDP shards by expert: choose a dp_shard that divides it")
