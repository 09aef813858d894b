"""What both step engines do alike once a step's gradient is judged (the closure mode's skeleton,
``step/skeleton.py``, and live mode's step, ``live/worker.py``): the per-parameter local norms of the
gradient judged, the rate the update uses, and the update itself (clip by the global norm, the optimizer's
step, then what follows it: the scheduler's step, an applied update only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainguard.norms import clip_grads_, local_grad_norms

Emit = Callable[..., None]


def emit_local_norm(emit: Emit, step: int, model: torch.nn.Module) -> None:
    """``guards.local_norm``: this rank's norm of each parameter's gradient (its shard's), before clipping,
    as the ``local_norm`` event of ``step`` (the closure mode's number)."""
    emit("local_norm", step=step, norms=local_grad_norms(model.named_parameters()))


def update_lr(optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """The learning rate the next update uses (read before the scheduler steps)."""
    if scheduler is not None:
        return scheduler.get_last_lr()[0]
    return optimizer.param_groups[0]["lr"]


def apply_update(grads: list[torch.Tensor], grad_clip: float, global_norm: float, optimizer: torch.optim.Optimizer,
                 after_optimizer: Callable[[], None]) -> None:
    """An applied update: the gradients clipped to ``grad_clip`` (0: off) by the step's global norm, the
    optimizer's step, then ``after_optimizer`` (the scheduler's step and the mode's own record of it)."""
    clip_grads_(grads, grad_clip, global_norm)
    optimizer.step()
    after_optimizer()
