"""Checkpoints written by verl's own ``FSDPCheckpointManager`` (verl 0.9.1, FSDP2 on CPU with gloo,
helpers/verl_fsdp_save.py) in trainguard's commands: ``ckpt merge`` with and without ``hf_model``,
both roles of a multi-role step, and ``ckpt convert`` into a trainguard checkpoint whose optimizer
state is keyed by parameter name and whose extra state (numpy RNG) loads through the allow-list."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.runs import events, ok, train, trainguard
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


@pytest.fixture(scope="module")
def converted(verl_run, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("converted") / "global_step_1"
    ok(trainguard("ckpt", "convert", "--from", str(verl_run / "global_step_1" / "actor"), "--to", str(target)))
    return target


def test_convert_names_the_optimizer_state_and_reads_numpy_rng(verl_run, converted):
    target = converted
    assert verify_checkpoint(target) == []
    state, reference = read_full_state_dict(target), _reference(verl_run, "actor", 1)
    for name, tensor in reference["model"].items():
        assert torch.equal(state[f"model.{name}"], tensor), name
    for name, entry in reference["optim"]["state"].items():  # torch's full optimizer state, keyed by name
        for key, value in entry.items():
            assert torch.equal(state[f"optim.state.{name}.{key}"], value), (name, key)
    assert state["optim.param_groups.model.norm.weight.lr"] == reference["optim"]["param_groups"][0]["lr"]
    for rank in (0, 1):
        theirs = safe_torch_load(verl_run / "global_step_1" / "actor" / f"extra_state_world_size_2_rank_{rank}.pt")
        ours = safe_torch_load(target / f"extra_state_world_size_2_rank_{rank}.pt")  # verl's RNG, in our form
        assert theirs["rng"]["numpy"][1].dtype.name == "uint32"  # read through the numpy allow-list
        assert ours["step"] == 1 and ours["rank"] == rank and ours["world_size"] == 2
        assert ours["rng"]["numpy"]["keys"].tolist() == theirs["rng"]["numpy"][1].tolist()
        assert torch.equal(ours["rng"]["torch"], theirs["rng"]["cpu"])
        assert ours["stateful"]["scheduler"] == theirs["lr_scheduler"]


def test_converted_checkpoint_resumes_in_the_reference_trainer(converted, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(run_dir, 2, 3, "--resume", str(converted), "--save-interval", "3"))  # llama-micro: verl's model
    started = events(run_dir, "run_started")[-1]
    assert started["step"] == 1 and started["resumed_from"] == str(converted)
    state = read_full_state_dict(run_dir / "checkpoints" / "global_step_3")
    # Adam's step count went on from verl's (1) through the two steps trained here: its state was loaded
    assert int(state["optim.state.model.norm.weight.step"]) == 3
