"""Every ``model.preset`` builds the architecture it names, and its model trains a step on the byte
tokenizer's ids (one forward and backward on the CPU, no process group)."""

from __future__ import annotations

import pytest
import torch

from trainguard.config.presets import PRESETS
from trainguard.config.schema import ModelConfig
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.tokenizer import ByteTokenizer

ARCHITECTURES = {  # preset: the Hugging Face class it must build
    "llama-micro": "LlamaForCausalLM",
    "qwen2-micro": "Qwen2ForCausalLM",
    "mistral-micro": "MistralForCausalLM",
    "mixtral-micro": "MixtralForCausalLM",
    "qwen2-moe-micro": "Qwen2MoeForCausalLM",
    "gpt2-micro": "GPT2LMHeadModel",
    "llama-tiny": "LlamaForCausalLM",
    "llama-60m": "LlamaForCausalLM",
}


def test_every_preset_is_listed():
    assert set(PRESETS) == set(ARCHITECTURES)


@pytest.mark.parametrize("preset", [p for p in ARCHITECTURES if p.endswith("-micro")])
def test_preset_builds_its_architecture_and_trains_a_step(preset):
    config = build_model_config(ModelConfig(preset=preset), max_position_embeddings=32)
    model = build_model(config, seed=0)
    assert type(model).__name__ == ARCHITECTURES[preset]
    assert config.vocab_size >= ByteTokenizer().vocab_size
    assert model.config.tie_word_embeddings == PRESETS[preset]["tie_word_embeddings"]
    ids = torch.randint(0, ByteTokenizer().vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
