"""Poisoned state: NaN or Inf in a rank's weights or optimizer state, found before a save commits it.

A checkpoint holding a non-finite weight or Adam moment is worse than none: ``--resume auto`` would
load it and every later step would be NaN. The step asks :func:`nonfinite_state` for this rank's
local shards (one host sync for all tensors), reduces the count over the ranks, and passes
:func:`poisoned_health` to the save: the checkpoint is committed marked unhealthy (kept for
inspection, never picked by ``auto`` resume, never written to the local tier).

:func:`local_state` is also what replica fingerprints hash (``guards.fingerprint``): the tensors a
rank holds, by a name that is the same on every replica.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainguard.guards.health import Health, marked_unhealthy

NamedTensors = list[tuple[str, torch.Tensor]]

# at most this many tensor names go into a checkpoint's health record (the count is always exact)
NAMES_RECORDED = 8


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: its shard of a DTensor, the tensor itself otherwise."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> NamedTensors:
    """This rank's floating-point parameter shards (``param:<name>``) and optimizer state shards
    (``<state key>:<name>``, e.g. ``exp_avg:model.norm.weight``), in a fixed order."""
    named: NamedTensors = []
    names: dict[int, str] = {}
    for name, parameter in model.named_parameters():
        names[id(parameter)] = name
        named.append((f"param:{name}", local_tensor(parameter.detach())))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                state: Mapping[str, Any] = optimizer.state.get(parameter, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        named.append((f"{key}:{names.get(id(parameter), '?')}", local_tensor(value.detach())))
    return [(name, tensor) for name, tensor in named if tensor.is_floating_point()]


def nonfinite_state(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding a NaN or an Inf (one host synchronisation for all of them)."""
    named = [(name, tensor) for name, tensor in named if tensor.numel()]
    if not named:
        return []
    # NaN propagates through min/max and an Inf is one of them: two fast reductions, not isfinite()'s
    # full boolean tensor
    extremes = torch.stack([torch.stack(torch.aminmax(tensor.detach().reshape(-1))).float() for _, tensor in named])
    flags = torch.isfinite(extremes).all(dim=1).logical_not().tolist()
    return [name for (name, _), bad in zip(named, flags) if bad]


def poisoned_health(tensors: int, names: Sequence[str] = ()) -> dict[str, Any] | None:
    """The health verdict of a save whose state holds ``tensors`` non-finite tensors over all ranks
    (``names``: some of them); None when there are none."""
    if tensors <= 0:
        return None
    return {"is_health": int(Health.UNHEALTHY), "reason": "non-finite state", "nonfinite_tensors": int(tensors),
            "tensors": list(names)[:NAMES_RECORDED]}


def merge_health(*verdicts: dict[str, Any] | None) -> dict[str, Any] | None:
    """One health record from several (embedding norm, state): unhealthy when any is; None when none is given."""
    given = [v for v in verdicts if v is not None]
    if not given:
        return None
    merged: dict[str, Any] = {}
    for verdict in given:
        merged.update(verdict)
    merged["is_health"] = int(Health.UNHEALTHY if any(marked_unhealthy(v) for v in given) else Health.HEALTHY)
    return merged


def state_save_health(health: dict[str, Any] | None, nonfinite: int, names: Sequence[str], unrepaired: int,
                      disagreeing: int, step: int, log: logging.Logger) -> dict[str, Any] | None:
    """The health of the save of ``step`` (``before_save``, the closure's and the live mode's): ``health``
    (the embedding norm's verdict) merged with the state's: ``nonfinite`` tensors holding a NaN/Inf over all
    ranks (``names``: this rank's), ``unrepaired`` ranks holding a mismatch no replica repaired, of them
    ``disagreeing`` from replicas that disagree (the rest changed at rest with no replica). An unhealthy
    verdict is logged on ``log``, one line."""
    verdicts = [health, poisoned_health(nonfinite, names)]
    if unrepaired:
        reason = "replicas disagree" if disagreeing else "state changed at rest"
        verdicts.append({"is_health": int(Health.UNHEALTHY), "reason": reason, "fingerprint_groups": unrepaired})
    merged = merge_health(*verdicts)
    if marked_unhealthy(merged):
        log.error("checkpoint of step %d is unhealthy and will not be resumed from: %s", step,
                  {k: v for k, v in merged.items() if k != "is_health"})
    return merged
