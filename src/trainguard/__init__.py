"""trainguard: keeps large-model training runs alive and their checkpoints trustworthy.

The public API for your own training loop:

- ``Guard``: the step protocol (resume, should_stop, step(loss_of), close) with every guard, checkpoint
  tier, fault drill and lifecycle feature behind it, configured by a ``Config`` (or its YAML file);
  ``StepOutcome`` is what ``Guard.step`` returns. See ``docs/library.md``. With
  ``fault_tolerance.live: true`` the same loop trains with live recovery instead (a rank dies, the
  others keep stepping, its replacement rejoins; same result). See ``docs/live_recovery.md``.
- ``data_parallel_mesh``: the mesh to shard the model over, the same call under ``torchrun`` and in
  live mode (None there: each rank holds the whole model). ``device_mesh(tp)``: the 2-D ``(dp_shard, tp)``
  mesh for tensor parallel inside each replica group, the same call in both modes.
- ``CheckpointManager``: durable async checkpoints with atomic commit, verification and exact resume.
- ``clip_grad_norm_``: the true global gradient norm under FSDP2/HSDP/TP/PP, and clipping by it.
- ``DataSkipGuard``: the global-norm spike rule (skip, count, abort) on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard._lazy import lazy_exports

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ below imports them, so they look unused
    from trainguard.checkpoint.manager import CheckpointManager  # noqa: F401
    from trainguard.guards.skip import DataSkipGuard  # noqa: F401
    from trainguard.norms import clip_grad_norm_  # noqa: F401
    from trainguard.step.guard import Config, Guard, StepOutcome  # noqa: F401
    from trainguard.step.mesh import data_parallel_mesh, device_mesh  # noqa: F401

__version__ = "0.1.0"

# Imported on first use: commands that never touch them (merge, list, plan) start seconds faster
# without torch.distributed.checkpoint and its dependencies.
_EXPORTS = {
    "checkpoint.manager": ("CheckpointManager",),
    "guards.skip": ("DataSkipGuard",),
    "norms": ("clip_grad_norm_",),
    "step.guard": ("Config", "Guard", "StepOutcome"),
    "step.mesh": ("data_parallel_mesh", "device_mesh"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names) + ["__version__"]
