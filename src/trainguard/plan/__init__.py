"""Checkpoint planning: sizes per tier, staging memory, retention storage, and the save interval."""

from trainguard.plan.interval import expected_goodput, optimal_save_interval
from trainguard.plan.sizing import CheckpointSizes, checkpoint_sizes, transformer_params

__all__ = ["CheckpointSizes", "checkpoint_sizes", "expected_goodput", "optimal_save_interval", "transformer_params"]
