"""Pure parts of the merge (placement math, shapes from the config, safetensors output) and the flags
that change the model's head (--is-value-model, --tie-word-embedding) on small one-rank checkpoints."""

from __future__ import annotations

import io
import json
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, GPT2Config, LlamaConfig, Qwen2Config

from trainguard.cli import main
from trainguard.merge.hf_layout import _llama_family_shapes
from trainguard.merge.placement import Placement, coordinate, local_block, parse_placement
from trainguard.merge.safetensors_out import OutputTensor, parse_size, plan_shards, write_safetensors

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=40, max_position_embeddings=16)


def cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def block_of(tensor: torch.Tensor, block) -> torch.Tensor:
    return tensor[tuple(slice(s, s + n) for s, n in block)]


@pytest.mark.parametrize("rows", [8, 7, 5, 3])
def test_blocks_follow_torch_chunk_on_hsdp_and_fsdp_x_tp(rows):
    full = torch.arange(rows * 6).reshape(rows, 6)
    hsdp = (parse_placement("Replicate()"), parse_placement("Shard(0)"))
    for rank in range(4):
        coord = coordinate(rank, (2, 2))
        assert torch.equal(block_of(full, local_block(full.shape, (2, 2), hsdp, coord)),
                           torch.chunk(full, 2, 0)[coord[1]] if coord[1] < len(torch.chunk(full, 2, 0)) else full[:0])
    # FSDP over TP on the same dim: FSDP chunks each TP shard (what DTensor calls _StridedShard)
    strided = (parse_placement("_S(0, 2)"), parse_placement("Shard(dim=0)"))
    for rank in range(4):
        d, t = coordinate(rank, (2, 2))
        expected = list(torch.chunk(list(torch.chunk(full, 2, 0))[t], 2, 0))
        expected = expected[d] if d < len(expected) else full[:0]
        assert torch.equal(block_of(full, local_block(full.shape, (2, 2), strided, (d, t))), expected)
    # row-wise TP on dim 1, FSDP on dim 0
    mixed = (Placement("shard", 0), Placement("shard", 1))
    assert local_block((rows, 6), (2, 2), mixed, (1, 1)) == ((-(-rows // 2), rows - -(-rows // 2)), (3, 3))


def test_placement_strings_and_bad_ones():
    assert parse_placement("_StridedShard(dim=1, sf=4)") == Placement("strided", 1, 4)
    with pytest.raises(Exception, match="partial"):
        parse_placement("Partial(sum)")
    with pytest.raises(Exception, match="unknown placement"):
        parse_placement("Shard(x)")


@pytest.mark.parametrize("config", [
    LlamaConfig(**TINY, tie_word_embeddings=False),
    LlamaConfig(**TINY, attention_bias=True, mlp_bias=True, head_dim=16),
    Qwen2Config(**TINY),
])
def test_shapes_from_the_config_match_the_transformers_model(config):
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config).state_dict()
        value = AutoModelForTokenClassification.from_config(config).state_dict()
    as_dict = config.to_dict()
    assert _llama_family_shapes(as_dict, False) == {k: tuple(v.shape) for k, v in causal.items()}
    assert _llama_family_shapes(as_dict, True) == {k: tuple(v.shape) for k, v in value.items()}


def test_safetensors_writer_streams_parts_and_shards(tmp_path):
    tensors = {f"t{i}": torch.randn(3 + i, 4) for i in range(5)}
    tensors["b"] = torch.randn(2, 2).to(torch.bfloat16)
    specs = [OutputTensor(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    assert len(plan_shards(specs, 100)) == 6 and parse_size("5GB") == 5 * 10**9 and parse_size("1MiB") == 2**20
    parts = ([v[:1], v[1:]] for v in tensors.values())  # two row blocks each
    files = write_safetensors(tmp_path, specs, parts, max_bytes=150)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files and len(files) > 1
    loaded = {k: v for f in files for k, v in load_file(tmp_path / f).items()}
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def one_rank_checkpoint(directory: Path, model: torch.nn.Module, config) -> Path:
    """A one-rank trainguard local checkpoint (test data)."""
    directory.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, directory / "model_world_size_1_rank_0.pt")
    params = {k: {"shape": list(v.shape), "dtype": "float32", "placements": ["Replicate()"]} for k, v in state.items()}
    (directory / "fsdp_config.json").write_text(json.dumps(
        {"FSDP_version": 2, "world_size": 1, "mesh_shape": [1], "mesh_dim_names": ["dp_shard"], "params": params}))
    config.save_pretrained(directory / "huggingface")
    return directory


def test_value_model_keeps_its_head_and_says_so(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, num_labels=1)
    critic = AutoModelForTokenClassification.from_config(config).eval()  # no dropout
    causal_config = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    source = one_rank_checkpoint(tmp_path / "critic", critic, causal_config)
    proc = cli("ckpt", "merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "no-flag"))
    assert proc.returncode == 1 and "value head" in proc.stderr and not (tmp_path / "no-flag").exists()
    assert cli("ckpt", "merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "hf"),
               "--is-value-model").returncode == 0
    merged = json.loads((tmp_path / "hf/config.json").read_text())
    assert merged["architectures"] == ["LlamaForTokenClassification"] and merged["num_labels"] == 1
    assert "score.weight" in load_file(tmp_path / "hf/model.safetensors")
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 40, (1, 8))
    assert torch.equal(loaded(input_ids=ids).logits, critic(input_ids=ids).logits)


@pytest.mark.parametrize("config", [  # GPT-2's input embedding is transformer.wte
    LlamaConfig(**TINY, tie_word_embeddings=False),
    GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=40, n_positions=16, tie_word_embeddings=False),
], ids=["llama", "gpt2"])
def test_tie_word_embedding_refuses_to_change_an_untied_model(tmp_path, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    untied = one_rank_checkpoint(tmp_path / "untied", model, config)
    proc = cli("ckpt", "merge", "--local_dir", str(untied), "--target_dir", str(tmp_path / "x"), "--tie-word-embedding")
    assert proc.returncode == 1 and "lm_head.weight differs" in proc.stderr and not (tmp_path / "x").exists()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    same = one_rank_checkpoint(tmp_path / "same", model, config)
    assert cli("ckpt", "merge", "--local_dir", str(same), "--target_dir", str(tmp_path / "tied"),
               "--tie-word-embedding").returncode == 0
    assert "lm_head.weight" not in load_file(tmp_path / "tied/model.safetensors")
    assert json.loads((tmp_path / "tied/config.json").read_text())["tie_word_embeddings"] is True
    ids = torch.randint(0, 40, (1, 8))
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "tied")(input_ids=ids).logits,
                       model(input_ids=ids).logits)


def test_a_wrong_shape_names_the_parameter(tmp_path):
    config = LlamaConfig(**TINY)
    source = one_rank_checkpoint(tmp_path / "ckpt", AutoModelForCausalLM.from_config(config), config)
    LlamaConfig(**{**TINY, "intermediate_size": 64}).save_pretrained(source / "huggingface")
    proc = cli("ckpt", "merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "out"))
    assert proc.returncode == 1 and "model.layers.0.mlp.gate_proj.weight merges to shape [48, 32]" in proc.stderr
    assert not (tmp_path / "out").exists()
