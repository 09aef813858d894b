"""The staging plan of a save, taken once per layout and refreshed for the next saves.

``get_state_dict`` and the walk that plans the staging copies cost tens of milliseconds per save in
Python (name lookups per parameter, FSDP module traversals, a DTensor rebuilt per tensor), which is
most of what a lazy async save still blocks for. Between two saves of one run nothing of that changes
but the optimizer's plain values (the learning rate a scheduler sets, a step count kept as a number):
the tensors are the same objects with the same storage, updated in place. ``CaptureCache`` keeps the
plan of the last save with a fingerprint of the live tensors (identity and storage address of every
parameter, buffer and optimizer-state tensor, and the parameter groups' membership; the model's
tensors from a walk kept until a module registers something, ``ModuleTensors``); while the
fingerprint holds, the next plan is the kept one with every plain value read again from the live
optimizer. The cache is used only where each plain value's source was found and checked against what
``get_state_dict`` returned; otherwise every save takes the state again.

The state is ``{"model": {fqn: ...}, "optim": {flattened key: ...}}`` with the optimizer flattened as
``torch.distributed.checkpoint.state_dict`` flattens it (``state.<fqn>.<name>``,
``param_groups.<fqn>.<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.checkpoint.module_tensors import ModuleTensors
from trainguard.checkpoint.snapshot import CopySplit, local_tensor, mutable_by_optimizer
from trainguard.checkpoint.staging import ReusableStager, StagingPlan, is_immutable


def fingerprint(module_tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple:
    """Identity and storage of every tensor a save reads (``module_tensors``: the model's parameters and
    buffers), and which parameters each group holds."""
    tensors = list(module_tensors)
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return (
        tuple((id(t), local_tensor(t).data_ptr()) for t in tensors),
        tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups),
        tuple(tuple(sorted(state)) for state in optimizer.state.values()),
    )


@dataclass(frozen=True)
class PlainValues:
    """Where each non-tensor value of ``state["optim"]`` lives in the optimizer: a parameter group's
    setting (``param_groups.<fqn>.<name>``, the same value for every parameter of the group, so read
    once per group and name) or a parameter's state (``state.<fqn>.<name>``)."""
    group_settings: tuple[tuple[int, str, tuple[str, ...]], ...]
    """``(group index, name, the flattened keys holding it)``."""
    state_values: tuple[tuple[str, torch.Tensor, str], ...]
    """``(flattened key, parameter, name)``."""

    def read(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The values as the live optimizer holds them now, by flattened key."""
        values: dict[str, Any] = {}
        groups = optimizer.param_groups
        for index, name, keys in self.group_settings:
            values.update(dict.fromkeys(keys, groups[index][name]))
        for key, param, name in self.state_values:
            values[key] = optimizer.state[param][name]
        return values


def plain_values(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> PlainValues | None:
    """Where to read each non-tensor value of ``state["optim"]`` again, checked to give the value it
    has now and to be immutable; None when one cannot be found (or ``state["model"]`` holds a
    non-tensor value)."""
    if any(not isinstance(v, torch.Tensor) for v in state["model"].values()):
        return None
    params = dict(model.named_parameters(remove_duplicate=False))
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    settings: dict[tuple[int, str], list[str]] = {}
    state_values: list[tuple[str, torch.Tensor, str]] = []
    expected: dict[str, Any] = {}
    for key, value in state.get("optim", {}).items():
        if isinstance(value, torch.Tensor):
            continue
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        param = params.get(fqn)
        if param is None:
            return None
        if kind == "param_groups" and id(param) in group_of:
            settings.setdefault((group_of[id(param)], name), []).append(key)
        elif kind == "state" and param in optimizer.state:
            state_values.append((key, param, name))
        else:
            return None
        expected[key] = value
    sources = PlainValues(tuple((index, name, tuple(keys)) for (index, name), keys in settings.items()),
                          tuple(state_values))
    try:
        current = sources.read(optimizer)
    except KeyError:
        return None
    for key, value in expected.items():
        now = current[key]
        if type(now) is not type(value) or now != value or not is_immutable(now):
            return None
    return sources


@dataclass(frozen=True)
class Capture:
    plan: StagingPlan
    split: CopySplit
    """``plan.copies`` sorted by when they are made: what ``mutable_by_optimizer`` names may be copied later."""


class CaptureCache:
    def __init__(self, take_state: Callable[[torch.nn.Module, torch.optim.Optimizer], dict[str, Any]],
                 stager: ReusableStager | None = None):
        """``take_state(model, optimizer)`` gives the state as described in the module's doc; ``stager``
        holds the buffers (default: a ``ReusableStager`` of its own)."""
        self.take_state = take_state
        self.stager = stager or ReusableStager()
        self._fingerprint: tuple | None = None
        self._capture: Capture | None = None
        self._plain: PlainValues | None = None
        self.module_tensors = ModuleTensors()
        self.hits = 0

    def take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Capture:
        """The staging plan of the live state (the caller makes its copies). Only one plan may be in
        use at a time: the buffers and the kept structure are reused by the next call."""
        current = fingerprint(self.module_tensors.of(model), optimizer)
        kept = self._capture
        if kept is not None and current == self._fingerprint:
            self.hits += 1
            staged = {part: dict(values) for part, values in kept.plan.staged.items()}
            if "optim" in staged:  # absent while the optimizer holds no state (plain SGD never does)
                staged["optim"].update(self._plain.read(optimizer))
            return Capture(StagingPlan(staged, kept.plan.copies), kept.split)
        state = self.take_state(model, optimizer)
        plan = self.stager.plan(state)
        capture = Capture(plan, CopySplit.of(plan.copies, mutable_by_optimizer(model, optimizer)))
        plain = plain_values(state, model, optimizer) if set(state) <= {"model", "optim"} else None
        if plain is None:
            self._fingerprint, self._capture, self._plain = None, None, None
        else:
            self._fingerprint, self._capture, self._plain = current, capture, plain
        return capture
