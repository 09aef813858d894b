"""FSDP2 inside each replica group of a live run (issue 35, item 3): tests/integration/live_fsdp_loop.py
shards its model with ``fully_shard`` over ``trainguard.data_parallel_mesh()`` (the replica group's mesh in
live mode), 2 replica groups x 2 ranks, 8 micro-batches, dropout and AdamW with the default clipping. Run
fault-free and with rank 3 SIGKILLed after step 3: its group is taken out whole (rank 2 ends with exit 20
and both are started again together, making a new default group for their mesh), group 0 computes both
groups' shares for steps 3-7 (each share at the same positions, one FSDP2 reduce-scatter per share, the
partials added in group order), the new group 1 joins at the last boundary with the survivors' shards.
Durable checkpoints every 4 steps (DCP of the DTensor shards). Every rank's final parameters and optimizer
state, and both durable checkpoints, are the fault-free run's, bitwise; and so is a fault-free run stopped
at step 5 (``train.exit_at_step``: saved) and started again with ``--resume auto``; and so is a job SIGKILLed
whole (launcher and ranks) after step 6, with the local tier on (every 2 steps) and the memory tier (every
step), run again with ``--resume auto``: it resumes from the memory tier's step, newer than the durable step 4. Replica fingerprints every 2
steps; in the stopped run rank 1 has a bit of its Adam moment flipped at rest before step 4: found, and
repaired from rank 3 (its replica) before that step computes, and rank 1's forward of step 2 raises once
mid-FSDP2: the quorum tries the step again (``fault_tolerance.max_step_failures``). And the killed run again
with 2 warm spares (``fault_tolerance.spares=2``: one spare group, which made its own default group and mesh
as it started): they take over group 1's positions, bitwise the fault-free run."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers.processes import alive
from helpers.live_fsdp import CLEAN, STEPS, TIMEOUT_S, WORLD, start_live_fsdp
from helpers.live_tensors import durable_tensors, final_tensors
from helpers.runs import finish_session
from trainguard.events.log import read_events
from trainguard.live.files import events_path, final_path
from trainguard.live.rank import GROUP_OUT_EXIT
from trainguard.live.sharded_params import chunk_rows

KILLED, KILL_AT = 3, 3
# a bit of rank 1's Adam moment flipped at rest before step 4, where replica fingerprints (every 2 steps) check
STATEFLIP = "stateflip:rank=1,step=4,site=3.weight,state=exp_avg,bit=30"
# rank 1's forward of micro-batch 3 of step 2 (its second of slot (0, 1)) raises once, between two FSDP modules
RAISE_AT = "1,2,3"
# the whole model's parameter shapes (live_fsdp_loop.py's MLP)
WHOLE = {"0.weight": (16, 8), "0.bias": (16,), "3.weight": (16, 16), "3.bias": (16,), "5.weight": (3, 16), "5.bias": (3,)}


def _sigkilled_job(run_dir: Path, config: Path) -> None:
    """The job started, SIGKILLed whole once every rank saved step 6 to the local tier (durable: step 4)."""
    proc = start_live_fsdp(config, run_dir, script=("--step-sleep", "0.5"))
    deadline = time.monotonic() + 120
    while not (events_path(run_dir).exists() and len({e["rank"] for e in read_events(events_path(run_dir))
                                                      if e["kind"] == "local_saved" and e["step"] == 6}) == WORLD):
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended, or took 120 s, before step 6"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    ranks = [e["pid"] for e in read_events(events_path(run_dir)) if e["kind"] == "live_start"]
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "ranks outlived their launcher by 60 s"
        time.sleep(0.1)


def _run(config: Path, run_dir: Path, *overrides: str, script: tuple[str, ...] = ()) -> None:
    done = finish_session(start_live_fsdp(config, run_dir, *overrides, script=script), TIMEOUT_S, str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _stopped_and_resumed(config: Path, run_dir: Path) -> None:
    _run(config, run_dir, "train.exit_at_step=5", f"faults={STATEFLIP}", script=("--raise-at", RAISE_AT))
    _run(config, run_dir)


def _sigkilled_and_resumed(config: Path, run_dir: Path) -> None:
    _sigkilled_job(run_dir, config)
    _run(config, run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, live_fsdp_clean) -> dict[str, Path]:
    """Each run (or stop and resume) in a thread of its own, all at once beside the session's fault-free run:
    most of a run is waits (start-up, a kill seen, the sigkilled job's sleeps), which they share."""
    root = tmp_path_factory.mktemp("live_fsdp")
    config = root / "live_fsdp.yaml"
    config.write_text(CLEAN, encoding="utf-8")
    local = root / "live_fsdp_local.yaml"
    # the local tier every 2 steps, the memory tier every step (its directory under the run's)
    local.write_text(CLEAN.replace("save_interval: 4", "save_interval: 4, local_interval: 2, memory_interval: 1, "
                                   "memory_dir: 'memory/node{node}'"), encoding="utf-8")
    killed = f"faults=kill:rank={KILLED},step={KILL_AT}"
    chains = {"killed": lambda: _run(config, root / "killed", killed),
              "spared": lambda: _run(config, root / "spared", killed, "fault_tolerance.spares=2"),
              "resumed": lambda: _stopped_and_resumed(config, root / "resumed"),
              "sigkilled": lambda: _sigkilled_and_resumed(local, root / "sigkilled")}
    with ThreadPoolExecutor(max_workers=len(chains)) as pool:
        futures = [pool.submit(chain) for chain in chains.values()]
    for future in futures:
        future.result()
    return {"clean": live_fsdp_clean.finished(), **{name: root / name for name in chains}}


def _final(run_dir: Path, rank: int) -> dict:
    return torch.load(final_path(run_dir, rank), weights_only=True)


@pytest.mark.parametrize("run", ["killed", "spared", "resumed", "sigkilled"])
def test_a_lost_fsdp2_group_or_a_resume_ends_bitwise_equal_to_the_fault_free_run(runs, run):
    for rank in range(WORLD):
        clean, other = final_tensors(runs["clean"], rank), final_tensors(runs[run], rank)
        assert clean.keys() == other.keys() and len(clean) == 24
        different = [name for name in clean if not torch.equal(clean[name], other[name])]
        assert not different, f"rank {rank}: {different}"
    clean = durable_tensors(runs["clean"], STEPS)
    assert len(clean) == 24 and [tuple(clean["model.0.weight"].shape)] == [WHOLE["0.weight"]]
    assert not [key for key, value in durable_tensors(runs[run], STEPS).items() if not torch.equal(value, clean[key])]


def test_fingerprints_found_the_flipped_fsdp2_shard_and_repaired_it_from_its_replica(runs):
    events = list(read_events(events_path(runs["resumed"])))
    assert [e["flipped"] for e in events if e["kind"] == "fault_injected"] == [True]
    found = [e for e in events if e["kind"] == "fingerprint_mismatch"]
    assert [(e["step"], e["group"], e["faulty"], e["repaired"]) for e in found] == [(4, [1, 3], [1], ["state"])]


def test_a_forward_that_raised_once_mid_fsdp2_was_tried_again_by_the_quorum(runs):
    # the end state is the fault-free run's bitwise (test_a_lost_fsdp2_group_..._fault_free_run[resumed])
    events = list(read_events(events_path(runs["resumed"])))
    failed = [(e["step"], e["ranks"], e["attempt"], e["verdict"], e["error"]) for e in events
              if e["kind"] == "live_step_failed"]
    assert failed == [(2, 1, 1, "retry", "rank 1: RuntimeError: injected: the forward failed once")]
    assert not [e for e in events if e["kind"] == "live_exit"]  # no rank crashed


def test_the_sigkilled_job_resumed_from_the_memory_tiers_newer_step(runs):
    events = list(read_events(events_path(runs["sigkilled"])))
    assert {e["tier"] for e in events if e["kind"] == "local_saved"} == {"local", "memory"}
    started = [e for e in events if e["kind"] == "run_started"]
    # every rank held step 6 in both tiers when the job was killed: the memory tier first at an equal step
    assert started and started[-1]["tier"] == "memory" and started[-1]["step"] >= 6


def test_each_step_of_the_lost_group_run_has_the_fault_free_loss_and_norm(runs):
    steps = {(event["step"], event["rank"]): event for event in read_events(events_path(runs["clean"]))
             if event["kind"] == "live_step"}
    for event in read_events(events_path(runs["killed"])):
        if event["kind"] == "live_step":  # each step's loss and global norm: the fault-free run's, bitwise
            assert (event["loss"], event["global_norm"]) == (steps[event["step"], event["rank"]]["loss"],
                                                             steps[event["step"], event["rank"]]["global_norm"])


def test_the_survivors_computed_the_lost_groups_share_and_kept_their_processes(runs):
    events = list(read_events(events_path(runs["killed"])))
    pids = defaultdict(list)
    for event in events:
        if event["kind"] == "live_start":
            pids[event["rank"]].append(event["pid"])
    assert len(pids[0]) == len(pids[1]) == 1 and len(pids[2]) == len(pids[3]) == 2
    # the group is taken out whole: rank 2 ends itself, and both of its ranks start again
    assert [e["rank"] for e in events if e["kind"] == "live_group_out"] == [2]
    assert {(e["target"], e["code"]) for e in events if e["kind"] == "live_exit"} == {(3, -9), (2, GROUP_OUT_EXIT)}
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}
    # slots (group, position): rank 0 computes slot (0, 0) = [0, 1] and group 1's slot (1, 0) = [4, 5]
    assert all(e["micro_batches"] == ([0, 1, 4, 5] if e["rank"] == 0 else [2, 3, 6, 7]) for e in degraded)
    assert {e["rank"] for e in events if e["kind"] == "live_joined"} == {2, 3}


def test_a_warm_spare_group_took_over_the_lost_groups_positions(runs):
    # the end state is the fault-free run's bitwise (test_a_lost_fsdp2_group_..._fault_free_run[spared])
    events = list(read_events(events_path(runs["spared"])))
    assert not [e for e in events if e["kind"] == "live_replacement"]  # no rank started cold
    started = {e["pid"]: e for e in events if e["kind"] == "live_start"}
    spares = {e["pid"]: e["spare"] for e in events if e["kind"] == "live_spare_checked"}
    assert sorted(spares.values()) == [0, 1]
    # spare s is position s % 2 of spare group 0: spare 0 became rank 2, spare 1 rank 3
    assert sorted((spares[pid], e["rank"]) for pid, e in started.items() if pid in spares) == [(0, 2), (1, 3)]
    assert {e["rank"] for e in events if e["kind"] == "live_joined"} == {2, 3}


def test_each_rank_holds_its_torch_chunk_rows_of_every_parameter(runs):
    for rank in range(WORLD):
        state = _final(runs["clean"], rank)
        for name, shape in WHOLE.items():
            first, end = chunk_rows(shape[0], 2, rank % 2)
            assert tuple(state["model"][name].shape) == (end - first, *shape[1:]), (rank, name)
    held = sum(_final(runs["clean"], 0)["model"][name].numel() for name in WHOLE)
    assert held * 2 > sum(torch.Size(shape).numel() for shape in WHOLE.values()) > held  # about half, shard 0 the longer
