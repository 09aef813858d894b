"""What a rank of a live run with sharded replica groups holds (``live/sharded_params.py``), asserted
from the local shard sizes of every rank's final state: shared by the live trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch

from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.live.compare import whole_final_state
from trainguard.live.files import final_path


def assert_each_rank_holds_its_share(run_dir: Path, world: int, group_size: int) -> None:
    """Each rank's final state holds exactly ``1/group_size`` of the model's parameters: its
    ``torch.chunk`` rows of each, and the optimizer state of those rows only (one entry per parameter,
    tied ones once, each of the local rows' size)."""
    whole = whole_final_state(run_dir, group_size)["model"]
    total = sum(tensor.numel() for tensor in whole.values())
    for rank in range(world):
        state = safe_torch_load(final_path(run_dir, rank))
        assert sum(tensor.numel() for tensor in state["model"].values()) * group_size == total, (run_dir, rank)
        for name, local in state["model"].items():
            assert torch.equal(local, whole[name].chunk(group_size)[rank % group_size]), (run_dir, rank, name)
        held = {tensor.untyped_storage().data_ptr(): tensor.numel() for tensor in state["model"].values()}
        moments = [entry["exp_avg"].numel() for entry in state["optimizer"]["state"].values()]
        assert sum(moments) == sum(held.values()) and len(moments) == len(held), (run_dir, rank)
