"""AdamW with linear warmup and cosine decay to ``min_lr_ratio``."""

from __future__ import annotations

import math

import torch

from trainguard.config.schema import OptimConfig


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index ``step``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    decay_steps = cfg.decay_steps or total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, decay_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler
