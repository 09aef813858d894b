"""verl's own tools on trainguard's checkpoints: verl 0.9.1's FSDP model merger (``python -m
verl.model_merger merge --backend fsdp``, installed without its GPU dependencies, see
helpers/verl_env.py) on a step of the local tier, FSDP and HSDP, Llama and Qwen2, gives every tensor that
``trainguard ckpt merge`` gives (verl writes bfloat16: compared with ours cast the same way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import ok, train, trainguard
from helpers.verl_env import VERL_MERGE, run_in_verl

FSDP = ["--save-interval", "0", "--set", "checkpoint.local_interval=2"]
HSDP = FSDP + ["--set", "parallel.dp_replicate=2", "--set", "parallel.ranks_per_node=2"]
QWEN2 = ["--set", "model.preset=qwen2-micro"]
ARCHITECTURES = {"fsdp": "LlamaForCausalLM", "hsdp": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen2-hsdp": "Qwen2ForCausalLM"}


def _merged(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl")
    for name, nproc, extra in (("fsdp", 2, FSDP), ("hsdp", 4, HSDP), ("qwen2", 2, FSDP + QWEN2),
                               ("qwen2-hsdp", 4, HSDP + QWEN2)):
        ok(train(root / name, nproc, 4, *extra))
    # HSDP: node 0's step holds ranks 0 and 1, the ranks verl reads (one replica)
    return {name: root / name / "local" / "node0" / "global_step_4" for name in ARCHITECTURES}


@pytest.fixture(scope="module")
def verl_merged(runs, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("verl_out")
    targets = {name: out / name for name in runs}
    pairs = [str(p) for name in runs for p in (runs[name], targets[name])]
    ok(run_in_verl(VERL_MERGE, *pairs))
    return targets


@pytest.mark.parametrize("layout", list(ARCHITECTURES))
def test_verl_merger_reads_a_local_step_as_trainguard_merges_it(runs, verl_merged, layout, tmp_path):
    step = runs[layout]
    ours = tmp_path / "ours"
    ok(trainguard("ckpt", "merge", "--local_dir", str(step), "--target_dir", str(ours), "--dtype", "fp32"))
    theirs, mine = _merged(verl_merged[layout]), _merged(ours)
    assert theirs.keys() == mine.keys() and len(mine) > 10
    config = json.loads((step / "fsdp_config.json").read_text())
    for key, tensor in mine.items():
        # full size (verl read every shard as a shard, not rank 0's alone), every value equal
        assert list(theirs[key].shape) == config["params"][key]["shape"], key
        assert theirs[key].dtype == torch.bfloat16 and torch.equal(theirs[key], tensor.to(torch.bfloat16)), key
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(verl_merged[layout]).architectures == [ARCHITECTURES[layout]]
    tokenizer = AutoTokenizer.from_pretrained(verl_merged[layout])  # the step's byte tokenizer, via tokenizer.json
    assert tokenizer.encode("héllo", add_special_tokens=False) == list("héllo".encode())
