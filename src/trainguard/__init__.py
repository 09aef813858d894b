"""trainguard: keeps large-model training runs alive and their checkpoints trustworthy.

The public API for your own training loop:

- ``CheckpointManager``: durable async checkpoints with atomic commit, verification and exact resume.
- ``clip_grad_norm_``: the true global gradient norm under FSDP2/HSDP/TP, and clipping by it.
"""

from trainguard.checkpoint.manager import CheckpointManager
from trainguard.norms import clip_grad_norm_

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "clip_grad_norm_", "__version__"]
