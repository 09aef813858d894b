"""The reference trainer in live mode with FSDP2 inside each replica group (issue 35, items 1 and 3):
``trainguard train --nproc 4`` with ``fault_tolerance.live=true``, ``fault_tolerance.fsdp=true``, 2 replica
groups x 2 (llama-micro, tied embeddings, AdamW with warmup and cosine, 8 steps of 4 micro-batches, durable
checkpoints every 4 steps, data skip and SDC detection at level 2 on). Each rank shards the model with ``fully_shard`` over
``trainguard.data_parallel_mesh()``, per decoder block and the root (``trainer/live.py``).

- rank 3 SIGKILLed after step 3 (the live drill's ``faults=kill:rank=3,step=3``): its group is taken out
  whole (rank 2 ends with exit 20), ranks 0 and 1 keep their processes, and every rank's final state and
  ``global_step_8`` are the fault-free run's, bitwise;
- a run stopped by ``train.exit_at_step=5`` (saved) and run again with ``--resume auto``: bitwise too;
- ``trainguard ckpt merge`` of the fault-free ``global_step_8`` (DCP of the DTensor shards, ``huggingface/``
  written by the trainer) gives a Hugging Face model that ``from_pretrained`` loads, its tensors the
  checkpoint's, bitwise (``ckpt test`` agrees).

The runs are one module fixture, so a further assertion on them costs no run of its own.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from helpers.runs import events as events_of, ok, trainguard
from helpers.sharded_state import assert_each_rank_holds_its_share
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.live.compare import bitwise_differences, run_differences
from trainguard.live.rank import GROUP_OUT_EXIT

STEPS, WORLD, GROUP, KILLED, KILL_AT, INTERVAL, STOP_AT = 8, 4, 2, 3, 3, 4, 5
TIMEOUT_S = 300
OVERRIDES = ("fault_tolerance.live=true", "fault_tolerance.fsdp=true", "parallel.dp_replicate=2",
             f"parallel.dp_shard={GROUP}", "guards.skip.enabled=true", "guards.sdc.enabled_level=2",
             "model.preset=llama-micro", "data.seq_len=32", "train.micro_batches=4", "data.micro_batch_size=2")


def _train(run_dir: Path, *extra: str):
    return ok(trainguard("train", "--nproc", str(WORLD), "--run-dir", str(run_dir), "--steps", str(STEPS),
                         "--save-interval", str(INTERVAL), *[arg for item in OVERRIDES for arg in ("--set", item)],
                         *extra, timeout=TIMEOUT_S))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_trainer_fsdp")
    outputs = {"clean": _train(root / "clean").stdout,
               "killed": _train(root / "killed", "--set", f"faults=kill:rank={KILLED},step={KILL_AT}").stdout,
               "stopped": _train(root / "resumed", "--set", f"train.exit_at_step={STOP_AT}").stdout,
               "resumed": _train(root / "resumed", "--resume", "auto").stdout}
    return root, outputs


def _final_checkpoint(run_dir: Path) -> dict:
    return read_full_state_dict(run_dir / "checkpoints" / f"global_step_{STEPS}")


def test_the_fault_free_run_is_judged_by_data_skip_and_sdc_and_nothing_is_abnormal(runs):
    root, outputs = runs
    assert f"live run finished: {STEPS} steps" in outputs["clean"] and "ranks replaced: none" in outputs["clean"]
    assert f"opt_global_step: {STEPS - 1}, skip_data_grad_norm_threshold:" in outputs["clean"]
    points = events_of(root / "clean", "sdc_points")
    assert points and all("model.norm" in event["names"] for event in points)
    for run in ("clean", "killed", "resumed"):
        assert not events_of(root / run, "data_skip") and not events_of(root / run, "sdc_detected"), run


def test_a_sigkilled_rank_takes_its_fsdp2_group_out_and_the_run_ends_bitwise_the_fault_free_one(runs):
    root, outputs = runs
    assert f"live run finished: {STEPS} steps" in outputs["killed"] and "ranks replaced: [2, 3]" in outputs["killed"]
    pids = defaultdict(list)
    for event in events_of(root / "killed", "live_start"):
        pids[event["rank"]].append(event["pid"])
    assert len(pids[0]) == len(pids[1]) == 1 and len(pids[2]) == len(pids[3]) == 2, pids  # survivors: same pids
    assert [e["pid"] for e in events_of(root / "killed", "live_kill")] == [pids[KILLED][0]]
    # FSDP2's path: the killed rank's group goes out whole, its other rank ends itself
    assert [e["rank"] for e in events_of(root / "killed", "live_group_out")] == [2]
    assert {(e["target"], e["code"]) for e in events_of(root / "killed", "live_exit")} == {(3, -9), (2, GROUP_OUT_EXIT)}
    assert run_differences(root / "clean", root / "killed", WORLD) == {}
    assert bitwise_differences(_final_checkpoint(root / "killed"), _final_checkpoint(root / "clean")) == []


def test_a_run_stopped_at_exit_at_step_resumes_auto_bitwise_the_unstopped_run(runs):
    root, outputs = runs
    saved = root / "resumed" / "checkpoints" / f"global_step_{STOP_AT}"
    assert f"live run stopped at step {STOP_AT}" in outputs["stopped"], outputs["stopped"][-2000:]
    assert f"live run resumes from {saved}" in outputs["resumed"], outputs["resumed"][-2000:]
    assert run_differences(root / "clean", root / "resumed", WORLD) == {}
    assert bitwise_differences(_final_checkpoint(root / "resumed"), _final_checkpoint(root / "clean")) == []


def test_each_rank_holds_half_of_its_groups_parameters(runs):
    root, _ = runs
    for run in ("clean", "killed", "resumed"):
        assert_each_rank_holds_its_share(root / run, WORLD, GROUP)


def test_the_merged_final_checkpoint_is_a_loadable_hugging_face_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, _ = runs
    checkpoint, merged = root / "clean" / "checkpoints" / f"global_step_{STEPS}", tmp_path / "merged"
    ok(trainguard("ckpt", "merge", "--local_dir", str(checkpoint), "--target_dir", str(merged)))
    assert ok(trainguard("ckpt", "test", "--local_dir", str(merged), "--reference", str(checkpoint))).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(merged)
    saved = {key.removeprefix("model."): value for key, value in _final_checkpoint(root / "clean").items()
             if key.startswith("model.")}
    loaded = model.state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as trained
    assert {key for key in saved if key != "lm_head.weight"} <= loaded.keys()
    assert not [key for key in saved if key in loaded and not torch.equal(saved[key], loaded[key])]
    with torch.no_grad():  # the merged model runs
        assert torch.isfinite(model(input_ids=torch.arange(8).reshape(1, 8)).logits).all()
