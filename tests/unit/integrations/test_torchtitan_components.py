"""trainguard.integrations.torchtitan.guard_components on what torchtitan's containers iterate: real torch
optimizers and LambdaLR schedulers (torchtitan itself: tests/integration/test_torchtitan.py)."""

from __future__ import annotations

import pytest
import torch

from trainguard.errors import ConfigError
from trainguard.integrations.torchtitan import guard_components


def adamw_and_schedule() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_the_one_optimizer_and_its_scheduler_go_to_guard():
    optimizer, scheduler = adamw_and_schedule()
    parts = guard_components([optimizer], [scheduler])
    assert parts.optimizer is optimizer and parts.scheduler is scheduler


def test_what_guard_cannot_step_alone_is_refused_in_one_line():
    (a, a_schedule), (b, b_schedule) = adamw_and_schedule(), adamw_and_schedule()
    with pytest.raises(ConfigError, match="this OptimizersContainer holds 2"):
        guard_components([a, b], [a_schedule, b_schedule])
    with pytest.raises(ConfigError, match="one scheduler of the container's optimizer"):
        guard_components([a], [b_schedule])

    class Container(torch.optim.Optimizer):  # what torchtitan's container is: an Optimizer over the same params
        def __init__(self, inner: torch.optim.Optimizer):
            self.inner = inner
            super().__init__([p for group in inner.param_groups for p in group["params"]], {})

        def __iter__(self):
            return iter([self.inner])

    hooked = Container(a)
    hooked.register_step_pre_hook(lambda optimizer, args, kwargs: None)  # MoE load balancing registers one
    with pytest.raises(ConfigError, match="step hooks of its own"):
        guard_components(hooked, [a_schedule])
    assert guard_components(Container(a), [a_schedule]).optimizer is a
