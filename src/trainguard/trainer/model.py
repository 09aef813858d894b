"""The reference model: a Hugging Face causal LM built from a config (never downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from trainguard.config.schema import ModelConfig

# vocab_size is padded past the byte tokenizer's 259 ids so it splits evenly across shards.
PRESETS: dict[str, dict] = {
    # for tests: fast on two CPU cores
    "llama-micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=160, vocab_size=320, tie_word_embeddings=True),
    # the default: a few million parameters
    "llama-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=688, vocab_size=320, tie_word_embeddings=True),
    # for benchmarks: about 60M parameters
    "llama-60m": dict(hidden_size=768, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048, vocab_size=320, tie_word_embeddings=True),
}

_OVERRIDES = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "tie_word_embeddings": "tie_word_embeddings",
}


def build_model_config(model: ModelConfig, max_position_embeddings: int) -> PretrainedConfig:
    if model.init_from is not None:  # the architecture of the Hugging Face directory (trainguard.hf)
        from trainguard.hf.config import model_config_from_hf

        return model_config_from_hf(model)
    params = dict(PRESETS[model.preset])
    for ours, theirs in _OVERRIDES.items():
        value = getattr(model, ours)
        if value is not None:
            params[theirs] = value
    return LlamaConfig(
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
