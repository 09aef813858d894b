"""The reference model: a Hugging Face causal LM built from a config (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from trainguard.config.presets import PRESETS
from trainguard.config.schema import ModelConfig
from trainguard.errors import ConfigError
from trainguard.hf import gpt2
from trainguard.hf.config import CONFIG_FILE, MODEL_KEYS, model_config_from_hf, model_keys, read_hf_config
from trainguard.hf.model_types import check_model_keys
from trainguard.trainer.tokenizer import ByteTokenizer


def explicit_model_keys(model: ModelConfig) -> dict[str, object]:
    """The ``model.*`` keys that name a Hugging Face config value, as set (None where not set)."""
    return {ours: getattr(model, ours) for ours in MODEL_KEYS}


def check_tokenizer_fits(model: ModelConfig, source: str) -> None:
    """With ``model.init_from``, the Hugging Face model's vocabulary must hold every id of the trainer's
    tokenizer (checked before processes start)."""
    if model.init_from is None:
        return
    config = read_hf_config(Path(model.init_from), model.attn_implementation)
    needed = ByteTokenizer().vocab_size
    if config.vocab_size < needed:
        raise ConfigError(f"{source}: model.init_from: {Path(model.init_from) / CONFIG_FILE}: vocab_size="
                          f"{config.vocab_size} is smaller than the trainer's tokenizer ({needed} ids)")


def check_positions_fit(model: ModelConfig, seq_len: int, source: str) -> None:
    """With ``model.init_from`` a GPT-2, ``data.seq_len`` must not exceed its ``n_positions``: it learns
    one embedding per position (``transformer.wpe``), where rotary positions have no such limit. (A
    preset's ``n_positions`` is ``data.seq_len`` itself.)"""
    if model.init_from is None:
        return
    config = read_hf_config(Path(model.init_from), model.attn_implementation)
    if config.model_type == gpt2.MODEL_TYPE and seq_len > config.n_positions:
        raise ConfigError(f"{source}: data.seq_len={seq_len} is longer than model.init_from's "
                          f"{Path(model.init_from) / CONFIG_FILE}: n_positions={config.n_positions} "
                          "(GPT-2 has one learned position embedding per position)")


def build_model_config(model: ModelConfig, max_position_embeddings: int) -> PretrainedConfig:
    if model.init_from is not None:  # the architecture of the Hugging Face directory (trainguard.hf)
        return model_config_from_hf(Path(model.init_from), model.attn_implementation, explicit_model_keys(model))
    params = dict(PRESETS[model.preset])
    model_type = params.pop("model_type", "llama")
    explicit = explicit_model_keys(model)
    check_model_keys(model_type, explicit)
    for ours, theirs in model_keys(model_type).items():
        if explicit[ours] is not None:
            params[theirs] = explicit[ours]
    return AutoConfig.for_model(
        model_type,
        **params,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        attn_implementation=model.attn_implementation,
    )


def build_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    """Initializes on the CPU from ``seed`` so every layout starts from the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    return model


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of a batch, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
