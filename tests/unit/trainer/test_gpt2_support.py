"""GPT-2 in the reference trainer, before any process starts: what it refuses (tensor and pipeline
parallel, keys GPT-2 has no setting for, sequences longer than its learned positions) as one line naming
the key and the model type with exit 2 and nothing written; and how its names are found (decoder blocks,
the tied ``lm_head``, ``n_inner`` None read as 4 x hidden)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainguard.cli import main
from trainguard.config.schema import ModelConfig
from trainguard.hf.config import model_config_from_hf, read_hf_config, tied_aliases
from trainguard.errors import ConfigError
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.parallelize import decoder_layers

PRESET = ["--set", "model.preset=gpt2-micro"]


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory) -> Path:
    """A GPT-2 as save_pretrained writes it: GPT-2's own config names, tied lm_head, n_inner None."""
    path = tmp_path_factory.mktemp("gpt2")
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=320, n_positions=32)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _refused(capsys, tmp_path, *args) -> str:
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not run_dir.exists(), "nothing may be written on bad input"
    return err


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_tensor_and_pipeline_parallel_are_refused_naming_key_and_model_type(capsys, tmp_path, hf_gpt2, key):
    layout = ["--nproc", "2", "--set", f"parallel.{key}=2", "--set", "train.micro_batches=2"]
    err = _refused(capsys, tmp_path, *PRESET, *layout)
    assert f"parallel.{key}=2 is not supported for model_type 'gpt2'" in err and "model.preset=gpt2-micro" in err
    # from Hugging Face weights too, and for pp before the tied-embedding rule (which GPT-2 would also break)
    err = _refused(capsys, tmp_path, "--set", f"model.init_from={hf_gpt2}", *layout)
    assert f"parallel.{key}=2 is not supported for model_type 'gpt2'" in err and "model.init_from" in err


def test_keys_gpt2_has_no_setting_for_and_too_long_sequences_are_refused(capsys, tmp_path, hf_gpt2):
    err = _refused(capsys, tmp_path, *PRESET, "--set", "model.num_kv_heads=2")
    assert "model.num_kv_heads=2: model_type 'gpt2' has no such setting" in err
    err = _refused(capsys, tmp_path, "--set", f"model.init_from={hf_gpt2}", "--set", "model.num_kv_heads=2")
    assert "model.num_kv_heads=2: model_type 'gpt2' has no such setting" in err
    err = _refused(capsys, tmp_path, "--set", f"model.init_from={hf_gpt2}", "--set", "data.seq_len=33")
    assert "data.seq_len=33" in err and "n_positions=32" in err


def test_n_inner_none_is_four_times_hidden(hf_gpt2):
    assert model_config_from_hf(hf_gpt2, "sdpa", {"intermediate_size": 128}).n_inner is None
    with pytest.raises(ConfigError, match=r"model.intermediate_size=64 disagrees with .*\(n_inner=128\)"):
        model_config_from_hf(hf_gpt2, "sdpa", {"intermediate_size": 64})
    config = build_model_config(ModelConfig(preset="gpt2-micro", intermediate_size=96), max_position_embeddings=16)
    assert config.n_inner == 96 and config.n_positions == 16 and config.resid_pdrop == 0.0


def test_decoder_blocks_and_tied_names(hf_gpt2):
    gpt2 = build_model(build_model_config(ModelConfig(preset="gpt2-micro"), max_position_embeddings=16), seed=0)
    assert decoder_layers(gpt2) is gpt2.transformer.h
    llama = build_model(build_model_config(ModelConfig(preset="llama-micro"), max_position_embeddings=16), seed=0)
    assert decoder_layers(llama) is llama.model.layers
    assert tied_aliases(read_hf_config(hf_gpt2)) == {"lm_head.weight": "transformer.wte.weight"}
    assert tied_aliases(llama.config) == {"lm_head.weight": "model.embed_tokens.weight"}
