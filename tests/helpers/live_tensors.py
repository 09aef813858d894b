"""A live run's tensors, flat by name, for bitwise comparisons: a rank's final state file and a durable
checkpoint read whole (DCP puts the ranks' shards together)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainguard.live.files import final_path


def final_tensors(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    """A rank's final model and optimizer-state tensors, named ``model.NAME`` and ``optimizer.INDEX.NAME``."""
    state = torch.load(final_path(run_dir, rank), weights_only=True)
    tensors = {f"model.{name}": value for name, value in state["model"].items()}
    for index, entry in state["optimizer"]["state"].items():
        tensors.update({f"optimizer.{index}.{name}": value for name, value in entry.items()})
    return tensors


def durable_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of a durable checkpoint, whole (DCP puts the shards together)."""
    path = run_dir / "checkpoints" / f"global_step_{step}"
    metadata = dcp.FileSystemReader(path).read_metadata()
    tensors = {key: torch.empty(item.size) for key, item in metadata.state_dict_metadata.items()
               if isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process reads it, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors
