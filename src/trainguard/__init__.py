"""trainguard: keeps large-model training runs alive and their checkpoints trustworthy.

The public API for your own training loop:

- ``CheckpointManager``: durable async checkpoints with atomic commit, verification and exact resume.
- ``clip_grad_norm_``: the true global gradient norm under FSDP2/HSDP/TP, and clipping by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.norms import clip_grad_norm_

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "clip_grad_norm_", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: commands that never touch them (merge, list, plan) start seconds faster
    # without torch.distributed.checkpoint and its dependencies.
    if name == "CheckpointManager":
        from trainguard.checkpoint.manager import CheckpointManager

        return CheckpointManager
    if name == "clip_grad_norm_":
        from trainguard.norms import clip_grad_norm_

        return clip_grad_norm_
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
