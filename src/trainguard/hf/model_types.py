"""Per supported model type: what its config calls trainguard's ``model.*`` keys, and which ``parallel.*``
splits the reference trainer cannot apply to it. Checked before any process starts, with no import of
transformers (``config.load`` runs for library users who never build a Hugging Face model)."""

from __future__ import annotations

from typing import Any

from trainguard.errors import ConfigError
from trainguard.hf import gpt2

# model_type -> {model.<key>: its config's name} where it differs from hf.config.MODEL_KEYS; None: the
# model type has no such setting, and setting the key is an error (not a value silently ignored)
KEY_NAMES: dict[str, dict[str, str | None]] = {gpt2.MODEL_TYPE: gpt2.KEY_NAMES}

# tensor parallel's plan (trainer.parallelize) splits a dense MLP's projections: an expert layer has none,
# so every expert would be replicated whole on every TP rank (there is no expert parallelism)
_FUSED_EXPERTS_TP = "its experts are fused 3-D parameters the TP plan does not split"

# model_type -> {parallel.<key>: why the reference trainer cannot split it that way}
UNSUPPORTED_PARALLEL: dict[str, dict[str, str]] = {
    gpt2.MODEL_TYPE: gpt2.UNSUPPORTED_PARALLEL,
    "mixtral": {"tp": _FUSED_EXPERTS_TP},
    "qwen2_moe": {"tp": _FUSED_EXPERTS_TP},
}


def config_value(config: Any, name: str) -> Any:
    """``config.<name>`` as the model reads it (GPT-2's ``n_inner`` None is 4 × ``n_embd``)."""
    if config.model_type == gpt2.MODEL_TYPE:
        return gpt2.config_value(config, name)
    return getattr(config, name)


def check_model_keys(model_type: str, explicit: dict[str, Any]) -> None:
    """Raises for a ``model.*`` key set (not None in ``explicit``) that ``model_type`` has no setting for."""
    for ours, theirs in KEY_NAMES.get(model_type, {}).items():
        if theirs is None and explicit.get(ours) is not None:
            raise ConfigError(f"model.{ours}={explicit[ours]}: model_type {model_type!r} has no such setting; "
                              f"unset model.{ours}")


def check_parallel_support(model_type: str, degrees: dict[str, int | None]) -> None:
    """Raises for a ``parallel.<key>`` above 1 in ``degrees`` that the reference trainer cannot apply to
    ``model_type``, naming the key and the model type."""
    for key, reason in UNSUPPORTED_PARALLEL.get(model_type, {}).items():
        degree = degrees.get(key) or 1
        if degree > 1:
            raise ConfigError(f"parallel.{key}={degree} is not supported for model_type {model_type!r}: "
                              f"{reason}; set parallel.{key}=1")
