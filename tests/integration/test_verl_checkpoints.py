"""Checkpoints written by verl's own ``FSDPCheckpointManager`` (verl 0.9.1, FSDP2 on CPU with gloo,
helpers/verl_fsdp_save.py) in trainguard's commands: ``ckpt merge`` with and without ``hf_model``,
both roles of a multi-role step, and ``ckpt convert`` into a trainguard checkpoint whose optimizer
state is keyed by parameter name and whose extra state (numpy RNG) loads through the allow-list."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import ok, trainguard
from helpers.verl_env import run_in_verl
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.checkpoint.manifest import verify_checkpoint
from trainguard.checkpoint.safe_load import safe_torch_load

SAVE = Path(__file__).resolve().parents[1] / "helpers" / "verl_fsdp_save.py"


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verl_ckpt")
    launch = f"import sys; from torch.distributed.run import main; sys.exit(main(['--nproc-per-node', '2', {str(SAVE)!r}, {str(out)!r}]))"
    ok(run_in_verl(launch))
    return out


def _merged(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _reference(run: Path, role: str, step: int) -> dict:
    return torch.load(run / f"reference_{role}_{step}.pt", weights_only=True)


@pytest.mark.parametrize("step,role", [(1, "actor"), (1, "critic"), (2, "actor")])
def test_merge_gives_the_trained_weights(verl_run, step, role, tmp_path):
    source = verl_run / f"global_step_{step}" / role
    ok(trainguard("ckpt", "merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "hf")))
    merged, reference = _merged(tmp_path / "hf"), _reference(verl_run, role, step)["model"]
    assert set(merged) == set(reference) - {"lm_head.weight"}  # tied: written once, as Hugging Face does
    assert all(torch.equal(merged[k], reference[k]) for k in merged)
    if (source / "huggingface" / "model.safetensors").is_file():  # hf_model: verl's own export, equal too
        exported = load_file(source / "huggingface" / "model.safetensors")
        assert exported.keys() == merged.keys() and all(torch.equal(exported[k], merged[k]) for k in merged)


def test_convert_names_the_optimizer_state_and_reads_numpy_rng(verl_run, tmp_path):
    source = verl_run / "global_step_1" / "actor"
    target = tmp_path / "converted"
    ok(trainguard("ckpt", "convert", "--from", str(source), "--to", str(target)))
    assert verify_checkpoint(target) == []
    state, reference = read_full_state_dict(target), _reference(verl_run, "actor", 1)
    for name, tensor in reference["model"].items():
        assert torch.equal(state[f"model.{name}"], tensor), name
    for name, entry in reference["optim"]["state"].items():  # torch's full optimizer state, keyed by name
        for key, value in entry.items():
            assert torch.equal(state[f"optim.state.{name}.{key}"], value), (name, key)
    assert state["optim.param_groups.model.norm.weight.lr"] == reference["optim"]["param_groups"][0]["lr"]
    for rank in (0, 1):
        extra = safe_torch_load(target / f"extra_state_world_size_2_rank_{rank}.pt")  # numpy RNG: allow-listed
        assert extra["rng"]["numpy"][1].dtype.name == "uint32" and len(extra["rng"]["numpy"][1]) == 624


def test_index_keyed_optimizer_of_another_model_is_one_clear_line(verl_run, tmp_path):
    source = tmp_path / "actor"
    import shutil

    shutil.copytree(verl_run / "global_step_1" / "actor", source)
    config = (source / "huggingface" / "config.json")
    config.write_text(config.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    result = trainguard("ckpt", "convert", "--from", str(source), "--to", str(tmp_path / "out"))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not this model's optimizer" in result.stderr and not (tmp_path / "out").exists()
