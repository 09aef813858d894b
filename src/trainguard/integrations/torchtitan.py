"""torchtitan's optimizer and LR scheduler containers on ``trainguard.Guard``.

torchtitan (0.3) holds a run's optimizers in an ``OptimizersContainer``: a ``torch.optim.Optimizer``
whose own ``state`` stays empty, the real state living in the optimizers it holds. Handed to ``Guard``
as the optimizer, its checkpoints held no optimizer state (a resumed run silently differed), and its
``LRSchedulersContainer`` has no ``get_last_lr`` (the first step failed). ``guard_components`` gives
``Guard`` the optimizer and the ``LambdaLR`` that the containers hold: every checkpoint then holds
their whole state (moments, step counts and param groups through DCP; the scheduler's ``last_epoch``,
``base_lrs`` and last LR in the extra state), and ``resume()`` restores it into torchtitan's own
objects, which the loop goes on using. Nothing here imports torchtitan.

::

    optimizers = optimizer_config.build(model_parts=[model])           # OptimizersContainer
    lr_schedulers = lr_scheduler_config.build(optimizers=optimizers, training_steps=steps)
    parts = guard_components(optimizers, lr_schedulers)
    guard = trainguard.Guard(run_dir, model, parts.optimizer, scheduler=parts.scheduler, ...)

``tests/integration/test_torchtitan.py`` runs it with torchtitan's own Llama 3 model, optimizer and
scheduler components on 2 gloo ranks: killed, resumed, bitwise equal to a run that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.errors import ConfigError


@dataclass(frozen=True)
class GuardComponents:
    """What ``Guard`` takes as its ``optimizer`` and ``scheduler``."""

    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch LR scheduler (torchtitan builds LambdaLR)


def guard_components(optimizers: Iterable[torch.optim.Optimizer], lr_schedulers: Iterable[Any]) -> GuardComponents:
    """The one optimizer of torchtitan's ``OptimizersContainer`` and the one scheduler of its
    ``LRSchedulersContainer`` (both iterate what they hold). ``Guard`` steps and saves one optimizer:
    a container of several (pipeline model parts, or parameter groups given different optimizer types)
    is refused, and so is one with step hooks of its own (torchtitan's MoE load balancing), which a
    step of the optimizer inside would bypass."""
    inner = list(optimizers)
    schedulers = list(lr_schedulers)
    if len(inner) != 1:
        raise ConfigError(f"torchtitan: Guard steps one optimizer; this OptimizersContainer holds {len(inner)} "
                          "(pipeline model parts or parameter groups with different optimizer types): not supported")
    hooks = [name for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
             if getattr(optimizers, name, None)]
    if hooks:
        raise ConfigError("torchtitan: the OptimizersContainer has step hooks of its own (such as MoE load balancing), "
                          "which Guard, stepping the optimizer inside it, would not run: not supported")
    if len(schedulers) != 1 or getattr(schedulers[0], "optimizer", None) is not inner[0]:
        raise ConfigError(f"torchtitan: the LRSchedulersContainer must hold one scheduler of the container's "
                          f"optimizer; it holds {len(schedulers)}")
    return GuardComponents(inner[0], schedulers[0])
