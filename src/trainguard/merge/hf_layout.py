"""What the merged model must look like: names and shapes from the Hugging Face config.

Every merged tensor is checked against the model ``config.json`` describes: an unexpected name, a
missing parameter or a wrong shape is an error naming the parameter, never a model that loads with
silently wrong or random weights. For the Llama family (llama, mistral, qwen2) the shapes follow from
the config by formula (no import of transformers, which costs seconds); any other model type is built
on the meta device (no memory, no weights) and its state dict read.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.errors import CheckpointError, ConfigError
from trainguard.hf import gpt2
from trainguard.merge.pieces import CheckpointContents, ShardedTensor

MODEL_PREFIX = "model."
INPUT_EMBEDDING = "model.embed_tokens.weight"
OUTPUT_EMBEDDING = "lm_head.weight"
# model_type -> its input embedding where it is not INPUT_EMBEDDING
INPUT_EMBEDDINGS = {gpt2.MODEL_TYPE: gpt2.INPUT_EMBEDDING}
VALUE_HEAD = "score.weight"
# where value heads live in the wild (verl's critic is a TokenClassification model: score.weight)
_VALUE_HEAD_NAMES = ("score.weight", "v_head.weight", "value_head.weight", "lm_head.weight")
_LLAMA_FAMILY = {"llama", "mistral", "qwen2"}

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "keep": None}


def load_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (the checkpoint's huggingface/ directory holds the model config "
                          "that the merge checks every shape against; for a checkpoint without one, pass "
                          "--hf_config DIR)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{path}: not a Hugging Face model config (no model_type)")
    return config


def parameter_order(hf_dir: Path) -> list[str]:
    """The parameter names of the model ``hf_dir/config.json`` describes, in ``model.parameters()`` order
    (a tied weight once), from the model built on the ``meta`` device: nothing is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = load_config(hf_dir)
    try:
        hf_config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{hf_dir / 'config.json'}: cannot build its model to name the optimizer's "
                          f"parameters ({exc})") from None
    return [name for name, _ in model.named_parameters()]


def is_value_config(config: dict[str, Any]) -> bool:
    return any(a.endswith("ForTokenClassification") for a in config.get("architectures") or [])


def output_config(config: dict[str, Any], tie: bool, value_model: bool, dtype: str | None) -> dict[str, Any]:
    out = copy.deepcopy(config)
    if tie:
        out["tie_word_embeddings"] = True
    if value_model and not is_value_config(config):
        base = (config.get("architectures") or [f"{config['model_type'].capitalize()}ForCausalLM"])[0]
        out["architectures"] = [base.removesuffix("ForCausalLM") + "ForTokenClassification"]
        out["num_labels"] = 1
        out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    if dtype is not None:
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
    return out


def _num_labels(config: dict[str, Any]) -> int:
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def _llama_family_shapes(c: dict[str, Any], value_model: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    qkv_bias = c["model_type"] == "qwen2" or bool(c.get("attention_bias"))
    mlp_bias = bool(c.get("mlp_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, hidden)
            if qkv_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if c.get("attention_bias"):
            shapes[f"{p}self_attn.o_proj.bias"] = (hidden,)
        for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            shapes[f"{p}mlp.{name}_proj.weight"] = shape
            if mlp_bias:
                shapes[f"{p}mlp.{name}_proj.bias"] = shape[:1]
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if value_model:  # a TokenClassification head: nn.Linear with a bias
        shapes["score.weight"] = (_num_labels(c), hidden)
        shapes["score.bias"] = (_num_labels(c),)
    else:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def expected_shapes(config: dict[str, Any], value_model: bool) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of the model ``config`` describes, in its own order."""
    if config["model_type"] in _LLAMA_FAMILY:
        try:
            return _llama_family_shapes(config, value_model)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"config.json: {config['model_type']} config without a usable {exc}") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    params = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **params)
    factory = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        model = factory.from_config(hf_config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@dataclass(frozen=True)
class MergePlan:
    outputs: list[tuple[str, ShardedTensor]]
    """(Hugging Face name, source tensor) in the model's own order."""
    config: dict[str, Any]
    check_tied: tuple[ShardedTensor, ShardedTensor] | None
    """(input embedding, output embedding) that --tie-word-embedding asserts are equal."""


def plan_merge(contents: CheckpointContents, config: dict[str, Any], tie: bool, value_model: bool,
               dtype: str | None = None) -> MergePlan:
    model = {key[len(MODEL_PREFIX):]: tensor for key, tensor in contents.tensors.items()
             if key.startswith(MODEL_PREFIX)}
    if not model:
        raise CheckpointError(f"{contents.description}: holds no model tensors")
    out_config = output_config(config, tie, value_model, dtype)
    expected = expected_shapes(out_config, value_model)
    check_tied = None
    if value_model and VALUE_HEAD not in model:
        head = next((n for n in _VALUE_HEAD_NAMES if n in model and model[n].shape[:1] == (1,)), None)
        if head is None:
            raise CheckpointError(f"{contents.description}: --is-value-model, but no value head "
                                  f"({', '.join(_VALUE_HEAD_NAMES)} with one output row) is in it")
        model[VALUE_HEAD] = model.pop(head)
        bias = head.removesuffix(".weight") + ".bias"
        if bias in model:
            model["score.bias"] = model.pop(bias)
    tied = bool(out_config.get("tie_word_embeddings", False))
    if tied and OUTPUT_EMBEDDING in model and not value_model:
        output = model.pop(OUTPUT_EMBEDDING)
        embedding = INPUT_EMBEDDINGS.get(config["model_type"], INPUT_EMBEDDING)
        if tie and not config.get("tie_word_embeddings", False) and embedding in model:
            check_tied = (model[embedding], output)  # trained untied: tying must not change the model
    if not value_model and VALUE_HEAD in model:
        raise CheckpointError(f"{contents.description}: holds a value head ({VALUE_HEAD}); pass --is-value-model")
    for name, tensor in model.items():
        if name not in expected:
            raise CheckpointError(f"{contents.description}: parameter {name} is not part of the "
                                  f"{config['model_type']} model the config describes")
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
