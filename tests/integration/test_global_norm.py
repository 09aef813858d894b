"""The global gradient norm under FSDP2, HSDP, FSDP×TP (and PP) equals the unsharded one."""

from __future__ import annotations

import math

import pytest

from helpers.runs import events, ok, trainguard, worker_env

# Every layout sees the same 4 samples in its first step: dp_size × micro_batch_size × micro_batches = 4.
LAYOUTS = {
    "single": (1, ["--set", "data.micro_batch_size=4"]),
    "fsdp2": (2, ["--set", "data.micro_batch_size=2"]),
    "hsdp2x2": (4, ["--set", "data.micro_batch_size=1", "--set", "parallel.dp_replicate=2",
                    "--set", "parallel.dp_shard=2"]),
    "fsdp2_tp2": (4, ["--set", "data.micro_batch_size=2", "--set", "parallel.dp_shard=2", "--set", "parallel.tp=2"]),
    # pipeline stages cannot share a tied embedding: compare against an untied unsharded model
    "single_untied": (1, ["--set", "data.micro_batch_size=4", "--set", "model.tie_word_embeddings=false"]),
    "pp2_fsdp2": (4, ["--set", "data.micro_batch_size=1", "--set", "train.micro_batches=2", "--set", "parallel.pp=2",
                      "--set", "parallel.dp_shard=2", "--set", "model.tie_word_embeddings=false"]),
}
REFERENCE = {"fsdp2": "single", "hsdp2x2": "single", "fsdp2_tp2": "single", "pp2_fsdp2": "single_untied"}


def _first_step(tmp_path_factory, name: str, nproc: int, extra: list[str]) -> dict:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    ok(trainguard("train", "--nproc", str(nproc), "--steps", "1", "--save-interval", "0", "--run-dir", str(run_dir),
                  "--set", "model.preset=llama-micro", "--set", "data.seq_len=32", *extra, env=worker_env()))
    return events(run_dir, "step")[0]


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory) -> dict[str, dict]:
    return {name: _first_step(tmp_path_factory, name, nproc, extra) for name, (nproc, extra) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(REFERENCE))
def test_norm_matches_unsharded(first_steps, layout):
    reference, sharded = first_steps[REFERENCE[layout]], first_steps[layout]
    assert math.isclose(sharded["global_norm"], reference["global_norm"], rel_tol=1e-5), (sharded, reference)
    assert math.isclose(sharded["loss"], reference["loss"], rel_tol=1e-6)
