"""Which parallel layouts the reference trainer runs a mixture-of-experts model on.

transformers keeps a Mixtral layer's experts as fused 3-D parameters (``hf.fused_experts``):
FSDP2 / HSDP shard them along dim 0, the expert dimension, so each rank holds whole experts when
``num_local_experts`` divides by ``parallel.dp_shard`` (checked, so that a rank's shard never cuts an
expert in two). Pipeline stages hold whole layers and need nothing more. Tensor parallel is refused:
its plan (``parallelize._TP_PLAN``) splits the dense MLP's projections, which a Mixtral layer does not
have, so every expert would be replicated on every TP rank, unsharded; there is no expert parallelism.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from trainguard.errors import ConfigError
from trainguard.hf.fused_experts import has_fused_experts
from trainguard.topology.layout import Layout


def check_expert_layout(model_config: PretrainedConfig, layout: Layout) -> None:
    """Raises ``ConfigError`` (one line naming the key and the model type) for a layout the trainer
    cannot run a model with fused experts on; nothing for other models."""
    model_type = model_config.model_type
    if not has_fused_experts(model_type):
        return
    if layout.tp > 1:
        raise ConfigError(f"parallel.tp={layout.tp}: tensor parallel is not supported for model_type {model_type!r} "
                          "(its experts are fused 3-D parameters the TP plan does not split); use parallel.tp=1")
    experts = model_config.num_local_experts
    if experts % layout.dp_shard:
        raise ConfigError(f"parallel.dp_shard={layout.dp_shard}: model_type {model_type!r} has num_local_experts="
                          f"{experts}, which FSDP shards by expert: choose a dp_shard that divides it")
