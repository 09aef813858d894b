"""verl's index-keyed optimizer state named through the model's parameter order (read_ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.errors import CheckpointError
from trainguard.merge.read_ranks import optimizer_by_name


def _state(n_params: int) -> dict:
    return {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.full((2,), float(i))} for i in range(n_params)},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]},
                             {"lr": 0.2, "betas": (0.9, 0.95), "params": list(range(1, n_params))}]}


def test_index_keys_become_parameter_names_with_their_group_settings():
    named = optimizer_by_name(_state(3), ["embed.weight", "norm.weight", "head.weight"], Path("optim.pt"))
    assert torch.equal(named["state.norm.weight.exp_avg"], torch.full((2,), 1.0))
    assert named["param_groups.embed.weight.lr"] == 0.1 and named["param_groups.head.weight.lr"] == 0.2
    assert "param_groups.head.weight.params" not in named
    assert {k.rsplit(".", 1)[0] for k in named if k.startswith("state.")} == {
        "state.embed.weight", "state.norm.weight", "state.head.weight"}


def test_another_models_optimizer_is_refused_naming_the_file():
    with pytest.raises(CheckpointError, match=r"optim\.pt: the optimizer's param groups list 3 parameters, the model "
                                              r"of huggingface/config.json has 2: not this model's optimizer"):
        optimizer_by_name(_state(3), ["a", "b"], Path("optim.pt"))
    state = _state(2)
    state["state"][5] = {"step": torch.tensor(1.0)}
    with pytest.raises(CheckpointError, match="parameter index 5, which no param group lists"):
        optimizer_by_name(state, ["a", "b"], Path("optim.pt"))
