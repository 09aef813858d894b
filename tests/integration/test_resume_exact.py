"""Exact resume: a run stopped and resumed ends bitwise identical to one that never stopped."""

from __future__ import annotations

import pytest

from helpers.runs import assert_same_tensors, events, ok, step_losses, train

LAYOUTS = {
    "fsdp2": (2, []),
    "hsdp2x2": (4, ["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=2"]),
    "fsdp2_tp2": (4, ["--set", "parallel.dp_shard=2", "--set", "parallel.tp=2"]),
    "pp2_fsdp2": (4, ["--set", "parallel.pp=2", "--set", "parallel.dp_shard=2", "--set", "train.micro_batches=2",
                      "--set", "model.tie_word_embeddings=false"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stop_and_resume_is_bitwise_identical(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(train(straight, nproc, 16, "--save-interval", "4", *extra))
    ok(train(split, nproc, 16, "--save-interval", "4", "--set", "train.exit_at_step=8", *extra))
    assert [e["step"] for e in events(split, "run_finished")] == [8]
    resumed = ok(train(split, nproc, 16, "--save-interval", "4", "--resume", "auto", *extra))
    assert "resumed from" in resumed.stdout and "global_step_8" in resumed.stdout

    compared = assert_same_tensors(straight / "checkpoints/global_step_16", split / "checkpoints/global_step_16")
    assert compared > 20  # model weights and both Adam moments of every parameter
    straight_losses, split_losses = step_losses(straight), step_losses(split)
    assert sorted(straight_losses) == list(range(1, 17))
    assert split_losses == straight_losses  # float equality: bitwise
