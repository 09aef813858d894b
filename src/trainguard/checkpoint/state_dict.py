"""The model's and optimizer's state dicts as every tier saves and loads them."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

# Optimizer state keyed by parameter name ("param_groups.<fqn>.lr"), never by group index: pipeline
# stages hold different parameters, and index-keyed groups of different stages would collide.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for a save; only ``"model"`` before the optimizer's first step.

    With no optimizer state yet (a step-0 save, or only skipped steps) ``get_state_dict`` would invent
    one (a zero-gradient step: Adam's step count becomes 1), so none is saved.
    """
    if optimizer is not None and optimizer.state:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model, options=STATE_DICT_OPTIONS)}
