"""What the merged model must look like: names and shapes from the Hugging Face config (pure given the config).

Every merged tensor is checked against the model the config describes, built on the meta device (no
memory, no weights): an unexpected name, a missing parameter or a wrong shape is an error naming the
parameter, never a model that loads with silently wrong or random weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig

from trainguard.errors import CheckpointError, ConfigError
from trainguard.merge.pieces import CheckpointContents, ShardedTensor

MODEL_PREFIX = "model."
INPUT_EMBEDDING = "model.embed_tokens.weight"
OUTPUT_EMBEDDING = "lm_head.weight"
VALUE_HEAD = "score.weight"
# where value heads live in the wild (verl's critic is a TokenClassification model: score.weight)
_VALUE_HEAD_NAMES = ("score.weight", "v_head.weight", "value_head.weight", "lm_head.weight")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "keep": None}


def load_config(hf_dir: Path) -> PretrainedConfig:
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"{hf_dir / 'config.json'}: missing (the checkpoint's huggingface/ directory "
                          "holds the model config that the merge checks every shape against)")
    try:
        return AutoConfig.from_pretrained(hf_dir)
    except Exception as exc:
        raise ConfigError(f"{hf_dir / 'config.json'}: unreadable ({type(exc).__name__}: {exc})") from None


def output_config(config: PretrainedConfig, tie: bool, value_model: bool) -> PretrainedConfig:
    out = copy.deepcopy(config)
    if tie:
        out.tie_word_embeddings = True
    if value_model:
        base = (config.architectures or [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"])[0]
        out.architectures = [base.removesuffix("ForCausalLM") + "ForTokenClassification"]
        out.num_labels = 1
    return out


def expected_shapes(config: PretrainedConfig, value_model: bool) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of the model ``config`` describes (built on meta)."""
    factory = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        model = factory.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@dataclass(frozen=True)
class MergePlan:
    outputs: list[tuple[str, ShardedTensor]]
    """(Hugging Face name, source tensor) in the model's own order."""
    config: PretrainedConfig
    check_tied: tuple[ShardedTensor, ShardedTensor] | None
    """(input embedding, output embedding) that --tie-word-embedding asserts are equal."""


def plan_merge(contents: CheckpointContents, config: PretrainedConfig, tie: bool, value_model: bool) -> MergePlan:
    model = {key[len(MODEL_PREFIX):]: tensor for key, tensor in contents.tensors.items()
             if key.startswith(MODEL_PREFIX)}
    if not model:
        raise CheckpointError(f"{contents.description}: holds no model tensors")
    out_config = output_config(config, tie, value_model)
    expected = expected_shapes(out_config, value_model)
    check_tied = None
    if value_model and VALUE_HEAD not in model:
        head = next((n for n in _VALUE_HEAD_NAMES if n in model and model[n].shape[:1] == (1,)), None)
        if head is None:
            raise CheckpointError(f"{contents.description}: --is-value-model, but no value head "
                                  f"({', '.join(_VALUE_HEAD_NAMES)} with one output row) is in it")
        model[VALUE_HEAD] = model.pop(head)
    tied = bool(getattr(out_config, "tie_word_embeddings", False))
    if tied and OUTPUT_EMBEDDING in model and not value_model:
        output = model.pop(OUTPUT_EMBEDDING)
        if tie and not getattr(config, "tie_word_embeddings", False) and INPUT_EMBEDDING in model:
            check_tied = (model[INPUT_EMBEDDING], output)  # trained untied: tying must not change the model
    if not value_model and VALUE_HEAD in model:
        raise CheckpointError(f"{contents.description}: holds a value head ({VALUE_HEAD}); pass --is-value-model")
    for name, tensor in model.items():
        if name not in expected:
            raise CheckpointError(f"{contents.description}: parameter {name} is not part of the "
                                  f"{type(out_config).__name__} model the config describes")
        if tensor.shape != expected[name]:
            raise CheckpointError(f"{contents.description}: parameter {name} merges to shape {list(tensor.shape)}, "
                                  f"but the config says {list(expected[name])}")
    skip = {OUTPUT_EMBEDDING} if tied else set()
    missing = [name for name in expected if name not in model and name not in skip]
    if missing:
        raise CheckpointError(f"{contents.description}: parameter {missing[0]} is missing "
                              f"({len(missing)} missing in all)")
    outputs = [(name, model[name]) for name in expected if name in model]
    return MergePlan(outputs, out_config, check_tied)
