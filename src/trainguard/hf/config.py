"""A local Hugging Face model directory: its config, its safetensors files, and whether they fit the model.

Everything here reads JSON and safetensors *headers* only (no tensor data), so a directory is checked
completely before any process starts, and each problem is one ``ConfigError`` naming the file or the
tensor at fault. Layouts accepted: ``model.safetensors`` alone, or ``model.safetensors.index.json``
whose ``weight_map`` names the shards (``model-0000i-of-0000n.safetensors``). Other ``*.safetensors``
files in the directory (``consolidated.safetensors`` and the like) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from trainguard.errors import ConfigError
from trainguard.hf.model_types import KEY_NAMES, check_model_keys, check_parallel_support, config_value
from trainguard.hf.fused_experts import StoredTensor, stored_tensors

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# the Llama layout (model.layers.N.{self_attn,mlp}), the same with mlp experts fused in memory
# (hf.fused_experts), and GPT-2's (hf/gpt2.py)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt2")

# trainguard's model.<key> -> the Hugging Face config's name for it: a preset's overrides, and the keys
# that must agree with the Hugging Face config when model.init_from is set
MODEL_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "tie_word_embeddings": "tie_word_embeddings",
}


def model_keys(model_type: str) -> dict[str, str | None]:
    """``MODEL_KEYS`` as ``model_type``'s config names them (None: it has no such setting)."""
    return {**MODEL_KEYS, **KEY_NAMES.get(model_type, {})}


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the directory, as its safetensors header describes it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def check_hf_dir(hf_dir: Path) -> Path:
    """The directory, if it exists and has a ``config.json``."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConfigError(f"{hf_dir}: no such Hugging Face model directory")
    if not (hf_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{hf_dir}: no {CONFIG_FILE} (not a Hugging Face model directory)")
    return hf_dir


def read_hf_config(hf_dir: Path, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """The model config of ``hf_dir/config.json`` (``SUPPORTED_MODEL_TYPES``, transformers' own config
    classes; no remote code is ever run)."""
    path = check_hf_dir(hf_dir) / CONFIG_FILE
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        return CONFIG_MAPPING[model_type].from_dict(data, attn_implementation=attn_implementation)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a valid {model_type} config ({exc})") from None


def model_config_from_hf(hf_dir: Path, attn_implementation: str, explicit: dict[str, Any]) -> PretrainedConfig:
    """The architecture of ``hf_dir``; raises if a ``model.*`` key set explicitly (``explicit``: its
    ``MODEL_KEYS`` that are not None) disagrees."""
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir, attn_implementation)
    check_model_keys(config.model_type, explicit)
    for ours, theirs in model_keys(config.model_type).items():
        value = explicit.get(ours)
        if value is not None and value != config_value(config, theirs):
            raise ConfigError(
                f"model.{ours}={value} disagrees with {hf_dir / CONFIG_FILE} ({theirs}={config_value(config, theirs)}); "
                f"with model.init_from the architecture comes from the Hugging Face config: unset model.{ours}"
            )
    return config


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open
    from safetensors.torch import _getdtype

    try:
        with safe_open(str(path), framework="pt") as handle:
            found = {}
            for name in handle.keys():
                tensor = handle.get_slice(name)
                found[name] = (tuple(tensor.get_shape()), _getdtype(tensor.get_dtype()))
            return found
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing") from None
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise ConfigError(f"{path}: not a readable safetensors file ({exc})") from None


def hf_tensors(hf_dir: Path) -> dict[str, HFTensor]:
    """Every tensor of the model directory, by name, with its file (checked: the index's shards exist and
    hold what the index says they hold)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no 'weight_map' object naming the tensors' files")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:
                raise ConfigError(f"{index}: tensor {name!r} maps to {file!r}, not a file name in the directory")
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            if not (hf_dir / file).is_file():
                raise ConfigError(f"{hf_dir / file}: missing, but {INDEX_FILE} names it for tensor {names[0]!r}"
                                  + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
    elif (hf_dir / SINGLE_FILE).is_file():
        by_file = {SINGLE_FILE: []}
    else:
        raise ConfigError(f"{hf_dir}: no {SINGLE_FILE} and no {INDEX_FILE} (no weights to load)")

    tensors: dict[str, HFTensor] = {}
    for file, names in by_file.items():
        path = hf_dir / file
        header = _header(path)
        for name in names:
            if name not in header:
                raise ConfigError(f"{path}: has no tensor {name!r}, which {INDEX_FILE} places there")
        for name, (shape, dtype) in header.items():
            if names and name not in names:
                continue  # the index is the authority on where each tensor lives
            tensors[name] = HFTensor(name, path, shape, dtype)
    return tensors


def build_empty_model(config: PretrainedConfig) -> nn.Module:
    """The Hugging Face model of ``config`` on the ``meta`` device (float32, ``use_cache`` off)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    return model


def expected_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a model built from ``config`` loads (no memory is allocated)."""
    model = build_empty_model(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def tied_aliases(config: PretrainedConfig) -> dict[str, str]:
    """{name: the name it shares its tensor with} for the tied parameters of the model ``config`` describes
    (``lm_head.weight`` -> ``model.embed_tokens.weight`` for a tied Llama, ``transformer.wte.weight`` for
    GPT-2): ``save_pretrained`` writes such a tensor under its first name only."""
    model = build_empty_model(config)
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def tensors_to_load(config: PretrainedConfig, tensors: dict[str, HFTensor], hf_dir: Path) -> dict[str, list[StoredTensor]]:
    """The model tensors to read from the directory for a model built from ``config``, each with the
    checkpoint tensors that hold it (``hf.fused_experts``: several for fused experts); raises naming
    the first checkpoint tensor that is missing, has another shape, or is not part of the model."""
    expected = expected_shapes(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    to_load: dict[str, list[StoredTensor]] = {}
    known = set()
    for name, shape in expected.items():
        if tied and name == "lm_head.weight" and name not in tensors:
            continue  # the output layer is the embedding, saved once
        stored = stored_tensors(config.model_type, name, shape)
        for part in stored:
            known.add(part.name)
            if part.name not in tensors:
                raise ConfigError(f"tensor {part.name!r} of the model is in none of the safetensors files of {hf_dir}")
            found = tensors[part.name]
            if found.shape != part.shape:
                raise ConfigError(f"{found.file}: tensor {part.name!r} has shape {list(found.shape)}, but the model "
                                  f"built from {CONFIG_FILE} expects {list(part.shape)}")
        to_load[name] = stored
    for name, found in tensors.items():
        if name not in known:
            raise ConfigError(f"{found.file}: tensor {name!r} is not a parameter of the model built from {CONFIG_FILE}")
    return to_load


def check_init_from(hf_dir: Path, attn_implementation: str, explicit: dict[str, Any], pp: int,
                    source: str, tp: int = 1) -> PretrainedConfig:
    """Everything about ``model.init_from`` that can be checked before processes start and without the
    trainer's tokenizer; returns the directory's config."""
    hf_dir = Path(hf_dir)
    try:
        config = model_config_from_hf(hf_dir, attn_implementation, explicit)
        check_parallel_support(config.model_type, {"tp": tp, "pp": pp})
        if pp > 1 and config.tie_word_embeddings:
            raise ConfigError(f"{hf_dir / CONFIG_FILE}: tie_word_embeddings=true, but parallel.pp > 1 "
                              "needs untied input and output embeddings")
        tensors_to_load(config, hf_tensors(hf_dir), hf_dir)
    except ConfigError as exc:
        raise ConfigError(f"{source}: model.init_from: {exc}") from None
    return config
