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

from helpers.runs import TINY, assert_same_tensors, events, flat_state, ok, step_losses, train, trainguard
from trainguard.cli import main

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=320, max_position_embeddings=64)
ARCHITECTURES = {  # name: (model_type, tied)
    "qwen2-tied": ("qwen2", True),
    "qwen2-untied": ("qwen2", False),
    "mistral": ("mistral", False),
    "gpt2": ("gpt2", True),
    "mixtral": ("mixtral", False),  # 8 experts, top-2: fused in memory, per expert in the files
    "qwen2-moe": ("qwen2_moe", False),  # the same, and a shared expert
}
MODEL_SIZES = {  # beyond SIZES (Qwen2-MoE's defaults are 60 experts of width 1408)
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=48, shared_expert_intermediate_size=96),
}
# GPT-2's own sizes: no num_key_value_heads, n_inner left None (4 x hidden), its default dropout 0.1 kept
GPT2_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
                  max_position_embeddings=64)
# model_type: (input embedding, final norm) where they are not Llama's
NAMES = {"gpt2": ("transformer.wte.weight", "transformer.ln_f.weight")}
LLAMA_NAMES = ("model.embed_tokens.weight", "model.norm.weight")


def write_hf_model(path: Path, model_type: str, tied: bool) -> Path:
    torch.manual_seed(5)
    sizes = GPT2_SIZES if model_type == "gpt2" else {**SIZES, **MODEL_SIZES.get(model_type, {})}
    config = AutoConfig.for_model(model_type, tie_word_embeddings=tied, **sizes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type in ("qwen2", "qwen2_moe", "gpt2"):  # biases start at zero; make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_()
    model.save_pretrained(path)
    return path


def source_tensors(hf_dir: Path, model_type: str) -> dict[str, torch.Tensor]:
    """The HF weights under the model's in-memory names: for Mixtral and Qwen2-MoE as transformers'
    ``from_pretrained`` fuses their per-expert tensors (an independent check of trainguard's own mapping)."""
    if model_type not in ("mixtral", "qwen2_moe"):
        return load_file(hf_dir / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()


def fsdp_bytes(tensors, rank: int, ranks: int) -> int:
    """The bytes of ``tensors`` in FSDP2 shard ``rank`` (``torch.chunk`` of dim 0: the last shards may be
    smaller or empty)."""
    total = 0
    for tensor in tensors:
        rows = -(-tensor.shape[0] // ranks)
        total += max(0, min(rows, tensor.shape[0] - rank * rows)) * tensor[0].numel() * tensor.element_size()
    return total


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
    source = source_tensors(hf_dir, model_type)
    init = ["--set", f"model.init_from={hf_dir}"]

    ok(train(tmp_path / "zero", 2, 3, *init, "--set", "train.exit_at_step=0"))
    # each rank read only its own slices (for Mixtral: its own experts' per-expert tensors)
    files = load_file(hf_dir / "model.safetensors").values()
    loads = sorted(events(tmp_path / "zero", "init_from"), key=lambda e: e["rank"])
    assert [e["bytes_read"] for e in loads] == [fsdp_bytes(files, rank, 2) for rank in (0, 1)]
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
    # the Hugging Face format, as save_pretrained writes it (Mixtral: one tensor per expert)
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == load_file(hf_dir / "model.safetensors").keys()
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


MOE_LAYOUTS = {  # on 2 ranks
    "fsdp": [],  # 2 of the 4 experts on each rank
    "hsdp": ["--set", "parallel.dp_replicate=2"],
    "pp": ["--set", "parallel.pp=2", "--set", "train.micro_batches=2"],
}


@pytest.mark.parametrize("preset,layout", [pytest.param("mixtral-micro", "fsdp")] + [
    pytest.param(preset, layout, marks=pytest.mark.slow)
    for preset in ("mixtral-micro", "qwen2-moe-micro") for layout in MOE_LAYOUTS
    if (preset, layout) != ("mixtral-micro", "fsdp")])
def test_moe_stop_and_resume_is_bitwise_identical(tmp_path, preset, layout):
    extra = ["--set", f"model.preset={preset}", *MOE_LAYOUTS[layout], "--save-interval", "2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(train(straight, 2, 4, *extra))
    ok(train(split, 2, 4, *extra, "--set", "train.exit_at_step=2"))
    resumed = ok(train(split, 2, 4, *extra, "--resume", "auto"))
    assert "resumed from" in resumed.stdout and "global_step_2" in resumed.stdout
    assert assert_same_tensors(straight / "checkpoints/global_step_4", split / "checkpoints/global_step_4") > 20
    assert "model.model.layers.1.mlp.experts.gate_up_proj" in flat_state(split / "checkpoints/global_step_4")
    assert sorted(step_losses(straight)) == [1, 2, 3, 4] and step_losses(split) == step_losses(straight)


@pytest.mark.slow
def test_mixtral_init_from_on_pipeline_stages(tmp_path):
    """Each pipeline stage reads its own layers' experts from the per-expert files."""
    hf_dir = write_hf_model(tmp_path / "hf", "mixtral", False)
    ok(train(tmp_path / "zero", 2, 3, "--set", f"model.init_from={hf_dir}", "--set", "parallel.pp=2",
             "--set", "train.micro_batches=2", "--set", "train.exit_at_step=0"))
    saved, source = model_tensors(tmp_path / "zero" / "checkpoints" / "global_step_0"), source_tensors(hf_dir, "mixtral")
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], source[k]) for k in source)


def test_moe_layouts_the_trainer_cannot_run_are_refused_before_any_process_starts(tmp_path, capsys):
    # the command in this process (``main``, what ``python -m trainguard`` runs): a refusal starts nothing,
    # so a new interpreter per case would only add its imports (seconds each on 2 busy cores)
    for preset, nproc, setting, line in [
        ("mixtral-micro", 2, "parallel.tp=2", "parallel.tp=2 is not supported for model_type 'mixtral': its experts are fused"),
        ("mixtral-micro", 3, "parallel.dp_shard=3", "parallel.dp_shard=3: model_type 'mixtral' has num_local_experts=4"),
        ("qwen2-moe-micro", 3, "parallel.dp_shard=3", "model_type 'qwen2_moe' has num_experts=4"),
    ]:
        code = main(["train", "--nproc", str(nproc), "--steps", "1", "--run-dir", str(tmp_path / "run"), *TINY,
                     "--set", f"model.preset={preset}", "--set", setting])
        err = capsys.readouterr().err
        assert code == 2
        assert len(err.strip().splitlines()) == 1 and line in err
        assert not (tmp_path / "run").exists()  # refused before the run directory, let alone a process
