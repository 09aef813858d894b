"""Architectures beyond Llama through ``model.init_from`` and ``ckpt merge``: Qwen2 (q/k/v biases; tied
and untied embeddings), Mistral and GPT-2 (fused ``c_attn``, ``Conv1D`` weights, LayerNorm biases, learned
positions, tied ``lm_head``), each from a config (no download). For each: the Hugging Face
weights -> ``init_from`` with ``train.exit_at_step=0`` (and ``ckpt convert --from-hf``) -> the step-0
checkpoint holds the source tensors bitwise; -> 4 steps on 2 ranks -> ``ckpt merge`` -> ``from_pretrained`` gives the logits of
the checkpoint's weights, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.runs import events, flat_state, ok, train, trainguard

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=320, max_position_embeddings=64)
ARCHITECTURES = {  # name: (model_type, tied)
    "qwen2-tied": ("qwen2", True),
    "qwen2-untied": ("qwen2", False),
    "mistral": ("mistral", False),
    "gpt2": ("gpt2", True),
}
# GPT-2's own sizes: no num_key_value_heads, n_inner left None (4 x hidden), its default dropout 0.1 kept
GPT2_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
                  max_position_embeddings=64)
# model_type: (input embedding, final norm) where they are not Llama's
NAMES = {"gpt2": ("transformer.wte.weight", "transformer.ln_f.weight")}
LLAMA_NAMES = ("model.embed_tokens.weight", "model.norm.weight")


def write_hf_model(path: Path, model_type: str, tied: bool) -> Path:
    torch.manual_seed(5)
    config = AutoConfig.for_model(model_type, tie_word_embeddings=tied, **(GPT2_SIZES if model_type == "gpt2" else SIZES))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type in ("qwen2", "gpt2"):  # biases start at zero; make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_()
    model.save_pretrained(path)
    return path


def model_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return {key[len("model."):]: value for key, value in flat_state(ckpt).items() if key.startswith("model.")}


# qwen2-tied (biases and tied embeddings) in the default suite; the others add a minute each on 2 busy cores
# (GPT-2's fast check: test_gpt2_preset_trains_on_two_ranks_and_merges)
@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == "qwen2-tied" else pytest.mark.slow)
                                  for name in ARCHITECTURES])
def test_init_from_train_merge_from_pretrained(tmp_path, name):
    model_type, tied = ARCHITECTURES[name]
    embedding, final_norm = NAMES.get(model_type, LLAMA_NAMES)
    hf_dir = write_hf_model(tmp_path / "hf", model_type, tied)
    source = load_file(hf_dir / "model.safetensors")
    init = ["--set", f"model.init_from={hf_dir}"]

    ok(train(tmp_path / "zero", 2, 3, *init, "--set", "train.exit_at_step=0"))
    saved = model_tensors(tmp_path / "zero" / "checkpoints" / "global_step_0")
    if tied:
        assert torch.equal(saved.pop("lm_head.weight"), source[embedding])
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], source[k]) for k in source)

    ok(trainguard("ckpt", "convert", "--from-hf", str(hf_dir), "--to", str(tmp_path / "converted")))
    converted = model_tensors(tmp_path / "converted" / "checkpoints" / "global_step_0")
    assert converted.keys() == saved.keys() | ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(converted[k], source[k]) for k in source)

    ok(train(tmp_path / "run", 2, 4, *init, "--save-interval", "4"))
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_4"
    ok(trainguard("ckpt", "merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "merged"), "--dtype", "fp32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.config.model_type == model_type and merged.config.tie_word_embeddings == tied
    trained = model_tensors(ckpt)
    assert not torch.equal(trained[final_norm], source[final_norm])  # it did train
    expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    expected.load_state_dict(trained, strict=not tied)
    expected.eval()  # from_config builds in training mode: GPT-2's dropout would be on
    ids = torch.arange(32).reshape(2, 16) * 7 % 259
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, expected(input_ids=ids).logits)


def test_gpt2_preset_trains_on_two_ranks_and_merges(tmp_path):
    """The default suite's GPT-2 check (the init_from case above is slow): ``model.preset=gpt2-micro``
    trains 2 steps with FSDP2 on 2 ranks, SDC detection on its LayerNorms, and merges into a model
    whose logits are those of the checkpoint's weights."""
    run = tmp_path / "run"
    ok(train(run, 2, 2, "--set", "model.preset=gpt2-micro", "--save-interval", "2",
             "--set", "guards.sdc.enabled_level=1"))
    points = events(run, "sdc_points")[0]["names"]
    norms = [f"transformer.h.{i}.{n}" for i in range(2) for n in ("ln_1", "ln_2")] + ["transformer.ln_f"]
    assert points[:7] == norms + ["transformer.h.0", "transformer.h.1"]  # LayerNorms, then the GPT2Blocks
    ckpt = run / "checkpoints" / "global_step_2"
    ok(trainguard("ckpt", "merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "merged"), "--dtype", "fp32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.config.architectures == ["GPT2LMHeadModel"] and merged.config.tie_word_embeddings
    trained = model_tensors(ckpt)
    assert torch.equal(trained["lm_head.weight"], trained["transformer.wte.weight"])
    expected = AutoModelForCausalLM.from_config(merged.config, dtype=torch.float32).eval()
    expected.load_state_dict(trained)
    ids = torch.arange(32).reshape(2, 16) * 7 % 259
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, expected(input_ids=ids).logits)
