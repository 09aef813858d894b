"""Tensor parallel inside each replica group of a live run (issue 35, item 3): tests/integration/live_tp_loop.py
splits its MLP block with ColwiseParallel / RowwiseParallel over ``trainguard.device_mesh(2)["tp"]`` and shards
every layer with ``fully_shard`` over its ``dp_shard`` dimension (1 here), 2 replica groups x tp 2 (4 ranks),
4 micro-batches, dropout and AdamW with the default clipping, durable checkpoints every 2 steps (each save
replaces the default group by the checkpoint group: the tp groups stay registered, ``replica_mesh``).
Fault-free; with rank 3 SIGKILLed after step 3 (its tp peer, rank 2, is taken out with it: exit 20, both start
again and rejoin, while group 0's two tp ranks compute all 4 micro-batches); stopped at step 3
(``train.exit_at_step``) and started again with ``--resume auto``; and saving only at the end. Every rank's
final parameters and optimizer state, and the final durable checkpoint, are the fault-free run's, bitwise.
And the reference trainer (``trainguard train``, llama-micro, restart mode's TP plan) in the same layout,
fault-free and with rank 3 SIGKILLed after step 3: bitwise too. The runs start together, in two waves (one
module fixture)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from helpers.live_tensors import durable_tensors, final_tensors
from helpers.runs import finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.events.log import read_events
from trainguard.live.files import events_path
from trainguard.live.rank import GROUP_OUT_EXIT

SCRIPT = Path(__file__).with_name("live_tp_loop.py")
STEPS, WORLD, KILLED, KILL_AT, STOP_AT = 6, 4, 3, 3, 3
CONFIG = """fault_tolerance: {live: true, fsdp: true}
parallel: {dp_replicate: 2, dp_shard: 1, tp: 2}
train: {micro_batches: 4, steps: %d}
checkpoint: {save_interval: 2}
""" % STEPS
# the whole model's parameter shapes (live_tp_loop.py's MLP: 0 column-wise, 2 row-wise, 5 not split)
WHOLE = {"0.weight": (16, 8), "0.bias": (16,), "2.weight": (8, 16), "2.bias": (8,), "5.weight": (3, 8), "5.bias": (3,)}
RUNS = {"clean": (), "killed": (f"faults=kill:rank={KILLED},step={KILL_AT}",),
        "resumed": (f"train.exit_at_step={STOP_AT}",), "saved_at_end": (f"checkpoint.save_interval={STEPS}",)}


TRAINER = ("fault_tolerance.live=true", "fault_tolerance.fsdp=true", "parallel.dp_replicate=2", "parallel.dp_shard=1",
           "parallel.tp=2", "model.preset=llama-micro", "data.seq_len=32", "train.micro_batches=4",
           "data.micro_batch_size=2")


def _start_trainer(run_dir: Path, *overrides: str):
    sets = [arg for item in (*TRAINER, *overrides) for arg in ("--set", item)]
    return warm_server().start(["train", "--nproc", str(WORLD), "--run-dir", str(run_dir), "--steps", str(STEPS),
                                "--save-interval", "2", *sets], worker_env())


def _start(config: Path, run_dir: Path, *overrides: str):
    sets = [arg for item in overrides for arg in ("--set", item)]
    return warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir), *sets,
                                "--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--config", str(config)],
                               worker_env())


def _finish(started: dict) -> None:
    for name, proc in started.items():
        done = finish_session(proc, 300, f"live tp run {name}")
        assert done.returncode == 0, name + ": " + done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_tp")
    config = root / "live_tp.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    _finish({name: _start(config, root / name, *overrides) for name, overrides in RUNS.items()})
    _finish({"resumed, again": _start(config, root / "resumed"), "trainer": _start_trainer(root / "trainer"),
             "trainer killed": _start_trainer(root / "trainer_killed", f"faults=kill:rank={KILLED},step={KILL_AT}")})
    return root


@pytest.mark.parametrize("run", ["killed", "resumed", "saved_at_end"])
def test_a_lost_tp_group_a_resume_or_fewer_saves_end_bitwise_equal_to_the_fault_free_run(runs, run):
    for rank in range(WORLD):
        clean, other = final_tensors(runs / "clean", rank), final_tensors(runs / run, rank)
        assert clean.keys() == other.keys() and len(clean) == 24
        assert not [name for name in clean if not torch.equal(clean[name], other[name])], rank
    clean = durable_tensors(runs / "clean", STEPS)
    assert {key: tuple(clean[f"model.{key}"].shape) for key in WHOLE} == WHOLE  # whole tensors, each once
    assert not [key for key, value in durable_tensors(runs / run, STEPS).items() if not torch.equal(value, clean[key])]


def test_the_killed_ranks_tp_peer_left_with_it_and_the_survivors_computed_every_micro_batch(runs):
    events = list(read_events(events_path(runs / "killed")))
    pids = defaultdict(list)
    for event in events:
        if event["kind"] == "live_start":
            pids[event["rank"]].append(event["pid"])
    assert len(pids[0]) == len(pids[1]) == 1 and len(pids[2]) == len(pids[3]) == 2
    assert {(e["target"], e["code"]) for e in events if e["kind"] == "live_exit"} == {(3, -9), (2, GROUP_OUT_EXIT)}
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    # both tp ranks of group 0 read the same micro-batches: their slot's and group 1's
    assert degraded and {e["rank"] for e in degraded} == {0, 1}
    assert all(e["micro_batches"] == [0, 1, 2, 3] for e in degraded)
    assert {e["rank"] for e in events if e["kind"] == "live_joined"} == {2, 3}


def test_each_tp_rank_holds_its_half_of_the_split_layers(runs):
    finals = [final_tensors(runs / "clean", rank) for rank in range(WORLD)]
    assert {key: tuple(finals[0][f"model.{key}"].shape) for key in WHOLE} == {
        "0.weight": (8, 8), "0.bias": (8,), "2.weight": (8, 8), "2.bias": (8,), "5.weight": (3, 8), "5.bias": (3,)}
    whole = durable_tensors(runs / "clean", STEPS)
    # rank r is tp rank r % 2: rows of the column-wise layer, columns of the row-wise one
    for rank in range(WORLD):
        half = rank % 2
        assert torch.equal(finals[rank]["model.0.weight"], whole["model.0.weight"][8 * half:8 * half + 8])
        assert torch.equal(finals[rank]["model.2.weight"], whole["model.2.weight"][:, 8 * half:8 * half + 8])
        assert torch.equal(finals[rank]["model.2.bias"], whole["model.2.bias"])


def test_the_reference_trainer_with_tp_ends_bitwise_equal_after_a_lost_group(runs):
    for rank in range(WORLD):
        clean, killed = final_tensors(runs / "trainer", rank), final_tensors(runs / "trainer_killed", rank)
        assert clean.keys() == killed.keys() and len(clean) > 40
        assert not [name for name in clean if not torch.equal(clean[name], killed[name])], rank
    # each tp rank holds half of the attention's heads: q_proj's rows of 64
    assert tuple(final_tensors(runs / "trainer", 1)["model.model.layers.0.self_attn.q_proj.weight"].shape) == (32, 64)
    assert {e["rank"] for e in read_events(events_path(runs / "trainer_killed")) if e["kind"] == "live_joined"} == {2, 3}
