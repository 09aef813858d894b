"""The memory tier's recycled files: a pruned step's state files are kept, uncommitted, as spares, and
the next save writes over them (the same inode) yet commits files that verify and load as written,
shorter ones cut to their size."""

from __future__ import annotations

from pathlib import Path

import torch

from trainguard.checkpoint.local.paths import SPARE_DIR, rank_file_names
from trainguard.checkpoint.local.reader import rank_holdings
from trainguard.checkpoint.local.writer import prune, rank_steps, save_rank_step
from trainguard.checkpoint.safe_load import safe_torch_load

WORLD, RANK = 2, 1


def _save(directory: Path, step: int, size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(step)
    model = {"w": torch.randn(size)}
    save_rank_step(directory, step, rank=RANK, world_size=WORLD, model_state=model,
                   optim_state={"m": model["w"] * 2}, extra_state=f"extra of step {step}".encode(),
                   replica_extras={0: b"extra of rank 0"}, fsdp_config={"world_size": WORLD}, recycle=True)
    return model


def test_a_pruned_steps_files_are_written_over_by_the_next_save_and_it_verifies(tmp_path: Path) -> None:
    names = rank_file_names(WORLD, RANK)
    _save(tmp_path, 1, 50_000)
    _save(tmp_path, 2, 50_000)
    assert prune(tmp_path, WORLD, RANK, keep_last=1, recycle=True) == [1]
    spare = tmp_path / SPARE_DIR / names["model"]
    assert spare.is_file() and not (tmp_path / "global_step_1").exists()
    assert rank_steps(tmp_path, WORLD, RANK) == [2]  # a spare is never a committed step
    inode, old_size = spare.stat().st_ino, spare.stat().st_size

    model = _save(tmp_path, 3, 20_000)  # smaller than the spare: the rest of the old bytes must go
    written = tmp_path / "global_step_3" / names["model"]
    assert written.stat().st_ino == inode and written.stat().st_size < old_size
    assert not spare.exists()
    held = rank_holdings(tmp_path, WORLD, RANK, [3])[3]  # every file hashed against the rank's manifest
    assert set(held.own) == {"model", "optim", "extra"} and set(held.replica_extras) == {0}
    assert torch.equal(safe_torch_load(written)["w"], model["w"])
    assert torch.equal(safe_torch_load(tmp_path / "global_step_3" / names["optim"])["m"], model["w"] * 2)
    assert (tmp_path / "global_step_3" / names["extra"]).read_bytes() == b"extra of step 3"
