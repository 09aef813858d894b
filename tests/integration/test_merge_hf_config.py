"""``ckpt merge --hf_config DIR`` (alias ``--hf_model_path``, verl's name) on a checkpoint a user's own loop
made with ``CheckpointManager`` and no ``huggingface/``: the merge reads the model config from DIR, copies
its config and tokenizer files but never its weights, and leaves the checkpoint verifiable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

import trainguard
from helpers.runs import ok, trainguard as cli

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(checkpoint without huggingface/, a Hugging Face model directory with config and weights, the
    trained parameters)."""
    root = tmp_path_factory.mktemp("user_ckpt")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoints = trainguard.CheckpointManager(root / "run", model, optimizer, save_interval=1, async_save=False)
    assert checkpoints.resume() == 0
    tokens = torch.arange(12)[None] % CONFIG["vocab_size"]
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    checkpoints.save(1, {"step": 1})
    checkpoints.close()
    hf_model = root / "hf_model"  # what verl's --hf_model_path names: the model the run started from
    model.config.save_pretrained(hf_model)
    save_file({"planted": torch.zeros(3)}, hf_model / "model.safetensors")
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    return root / "run" / "checkpoints" / "global_step_1", hf_model, trained


def test_merge_without_a_config_names_the_option(user_checkpoint, tmp_path):
    ckpt, _, _ = user_checkpoint
    assert not (ckpt / "huggingface").exists()
    proc = cli("ckpt", "merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "config.json: missing" in proc.stderr and "--hf_config" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--hf_config", "--hf_model_path"])
def test_merge_with_a_config_from_elsewhere(user_checkpoint, tmp_path, flag):
    ckpt, hf_model, trained = user_checkpoint
    out = tmp_path / "out"
    ok(cli("ckpt", "merge", "--local_dir", str(ckpt), "--target_dir", str(out), flag, str(hf_model)))
    merged = load_file(out / "model.safetensors")
    assert set(merged) == set(trained)
    assert all(torch.equal(merged[name], trained[name]) for name in trained)
    assert (out / "config.json").is_file()
    assert "planted" not in merged  # DIR's own weights are not copied over the merged ones
    # the checkpoint was only read: it still verifies, with nothing added to it
    verify = ok(cli("ckpt", "verify", str(ckpt)))
    assert verify.stdout.strip() == "OK global_step_1"
    assert not (ckpt / "huggingface").exists()
