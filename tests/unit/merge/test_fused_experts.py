"""Mixtral's and Qwen2-MoE's fused experts against transformers itself: the mapping between the model in memory
(``mlp.experts.gate_up_proj`` ...) and the per-expert checkpoint ``save_pretrained`` writes, reading it
(``tensors_to_load``, the DCP reader of ``model.init_from``, ``ckpt convert --from-hf``) and writing it
(``ckpt merge`` streaming a fused tensor in row blocks), all in one process on a model of a few KB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from trainguard.errors import ConfigError
from trainguard.hf.config import build_empty_model, hf_tensors, read_hf_config, tensors_to_load
from trainguard.hf.convert import hf_to_durable
from trainguard.hf.fused_experts import stored_tensors
from trainguard.hf.init import load_hf_weights, materialize
from trainguard.merge.compare import compare_tensors, reference_tensors
from trainguard.merge.compare import hf_tensors as merged_tensors
from trainguard.merge.merger import merge_to_hf
from trainguard.merge.split_experts import split_stream

EXPERTS, INTERMEDIATE, HIDDEN = 4, 24, 32


SIZES = {  # model_type: its own config keys for the expert count and widths
    "mixtral": dict(num_local_experts=EXPERTS, intermediate_size=INTERMEDIATE),
    "qwen2_moe": dict(num_experts=EXPERTS, moe_intermediate_size=INTERMEDIATE, intermediate_size=40,
                      shared_expert_intermediate_size=16),
}


def saved_model(model_type: str, path: Path) -> tuple[torch.nn.Module, Path]:
    """A model built from a config, and the directory its ``save_pretrained`` wrote."""
    torch.manual_seed(3)
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2,
                                  max_position_embeddings=32, **SIZES[model_type])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=list(SIZES))
def moe(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return saved_model(request.param, tmp_path_factory.mktemp(request.param) / "hf")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return saved_model("mixtral", tmp_path_factory.mktemp("mixtral") / "hf")


def test_the_mapping_is_what_save_pretrained_writes(moe):
    model, path = moe
    saved = load_file(path / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # fused in memory
    assert not any(".experts.gate_up_proj" in name for name in saved)  # per expert in the file
    mapped = {}
    for name, tensor in model.state_dict().items():
        parts = stored_tensors(model.config.model_type, name, tuple(tensor.shape))
        for part in parts:
            mapped[part.name] = tensor[part.block(tensor.dim())].reshape(part.shape)
        # the parts tile the model tensor in its byte order: written one after another, they are its bytes
        assert torch.equal(torch.cat([saved[part.name].reshape(-1) for part in parts]), tensor.reshape(-1))
    assert mapped.keys() == saved.keys()
    assert all(torch.equal(mapped[name], saved[name]) for name in saved)
    # gate before up in gate_up_proj, as transformers fuses them
    gate = {"mixtral": "block_sparse_moe.experts.2.w1.weight", "qwen2_moe": "mlp.experts.2.gate_proj.weight"}
    w1 = saved["model.layers.0." + gate[model.config.model_type]]
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, :INTERMEDIATE], w1)


def test_other_model_types_are_stored_as_they_are():
    assert stored_tensors("llama", "model.layers.0.mlp.gate_proj.weight", (8, 4))[0].name == "model.layers.0.mlp.gate_proj.weight"


def test_split_stream_cuts_row_blocks_into_per_expert_tensors(mixtral):
    model, path = mixtral
    saved = load_file(path / "model.safetensors")
    fused = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    parts = stored_tensors("mixtral", "model.layers.1.mlp.experts.gate_up_proj", tuple(fused.shape))
    # three experts in one rank's block, one in the other's: a cut falls inside a run, and runs span blocks
    streams = [iter([fused[:3], fused[3:]])]
    written = [torch.cat([piece.reshape(-1) for piece in run]) for run in split_stream(streams, [parts])]
    assert len(written) == 2 * EXPERTS
    assert all(torch.equal(out, saved[part.name].reshape(-1)) for out, part in zip(written, parts))


def test_tensors_to_load_checks_the_per_expert_names_and_shapes(mixtral, tmp_path):
    _, path = mixtral
    config = read_hf_config(path)
    to_load = tensors_to_load(config, hf_tensors(path), path)
    assert [p.name for p in to_load["model.layers.0.mlp.experts.down_proj"]][:2] == [
        "model.layers.0.block_sparse_moe.experts.0.w2.weight", "model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    saved = load_file(path / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((path / "config.json").read_bytes())
    missing = {k: v for k, v in saved.items() if k != "model.layers.1.block_sparse_moe.experts.3.w3.weight"}
    save_file(missing, broken / "model.safetensors")
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w3\.weight' "
                                          r"of the model is in none"):
        tensors_to_load(config, hf_tensors(broken), broken)
    reshaped = dict(saved, **{"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(HIDDEN, 8)})
    save_file(reshaped, broken / "model.safetensors")
    with pytest.raises(ConfigError, match=r"experts\.1\.w2\.weight' has shape \[32, 8\], but the model .* "
                                          r"expects \[32, 24\]"):
        tensors_to_load(config, hf_tensors(broken), broken)


def test_init_from_reader_fills_the_fused_parameters(moe):
    model, path = moe
    config = read_hf_config(path)
    empty = build_empty_model(config)
    materialize(empty, torch.device("cpu"), empty)
    load_hf_weights(empty, config, path)  # one process: DCP without a process group
    expected = model.state_dict()
    loaded = empty.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_convert_then_merge_gives_the_model_back(moe, tmp_path):
    """``ckpt convert --from-hf`` then ``ckpt merge``: the merged directory holds exactly what
    ``save_pretrained`` wrote, ``ckpt test`` finds it equal to the checkpoint, and ``from_pretrained``
    reads it into the same model."""
    model, path = moe
    step = hf_to_durable(path, tmp_path / "converted", progress=False)
    merge_to_hf(step, tmp_path / "merged")
    saved, merged = load_file(path / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == saved.keys() and all(torch.equal(merged[k], saved[k]) for k in saved)
    compared, differences = compare_tensors(merged_tensors(tmp_path / "merged"), reference_tensors(step, tmp_path / "merged"))
    assert (compared, differences) == (len(saved), [])  # ckpt test reads the checkpoint under the same names
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert again.config.architectures == [type(model).__name__]  # MixtralForCausalLM, Qwen2MoeForCausalLM
    ids = torch.arange(24).reshape(2, 12) * 11 % 300
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
