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
fault-free and with rank 3 SIGKILLed after step 3: bitwise too.

With the guards (the same layout and configuration, a guard added):
- SDC detection (``guards.sdc.enabled_level: 2``, ``strikes: 2``, module points ``1``, the Tanh on the column-wise
  layer's split output, and ``4``, the Tanh on the row-wise layer's replicated output; each tp rank's value a
  point of its own, ``NAME (tp T)``): on without a fault, every rank's end state is the fault-free run's (SDC
  off) bitwise; rank 1's (tp rank 1 of group 0) gradient into module 4 scaled x1e9 once at step 3 and once at
  step 5 (the drill's transient ``scale``): found at level 1 at ``1 (tp 1)`` and ``4 (tp 1)`` only, computed by
  rank 1, the clean rerun used, a strike each time; the second reaches ``strikes``: rank 1 writes its
  ``faulty_ranks.json`` entry and exits 17, its tp peer exits 20, both start again and rejoin, and every rank
  ends with the fault-free run's state bitwise;
- rollback mode (dropout off): the loss of data position 4 multiplied by 10^4; step 5 spikes, every rank
  restores ``global_step_4`` and the window skips positions [4, 6): bitwise the run never fed them;
- data skip with the drill's ``nan:step=3`` and ``bitflip`` of the gradient into module 1 on rank 1 alone (its
  tp piece) at step 4: both steps skipped by every rank, bitwise a fault-free run replaying those skips;
- rank 3 SIGSTOPped from outside once rank 0 has committed two steps, SIGCONTed once the stall verdict is recorded
  (``stall_s: 3``, saved at the end only): the stall watch takes group 1 out, group 0 goes on, ranks 2 and 3 exit 20 after the SIGCONT,
  start again and rejoin; bitwise the fault-free run.

The runs start together, at most seven at a time (one module fixture): each run that ends lets the next one
start, the resumed run's second half once its first half ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers.live_tensors import durable_tensors, final_tensors
from helpers.runs import events as events_of, finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.events.log import read_events
from trainguard.guards.sdc import faulty_ranks_path
from trainguard.live.files import events_path
from trainguard.live.rank import GROUP_OUT_EXIT

SCRIPT = Path(__file__).with_name("live_tp_loop.py")
STEPS, WORLD, KILLED, KILL_AT, STOP_AT = 6, 4, 3, 3, 3
# the heartbeat timeout is long: many 4-rank runs started together on a small machine can be silent for longer
# than the default 10 s (no run here drills a hang; a killed rank is seen by its exit)
CONFIG = """fault_tolerance: {live: true, fsdp: true, hang_s: 60}
parallel: {dp_replicate: 2, dp_shard: 1, tp: 2}
train: {micro_batches: 4, steps: %d}
checkpoint: {save_interval: 2}
""" % STEPS
# the whole model's parameter shapes (live_tp_loop.py's MLP: 0 column-wise, 2 row-wise, 5 not split)
WHOLE = {"0.weight": (16, 8), "0.bias": (16,), "2.weight": (8, 16), "2.bias": (8,), "5.weight": (3, 8), "5.bias": (3,)}
RUNS = {"clean": (), "killed": (f"faults=kill:rank={KILLED},step={KILL_AT}",),
        "resumed": (f"train.exit_at_step={STOP_AT}",), "saved_at_end": (f"checkpoint.save_interval={STEPS}",)}
SDC = CONFIG + 'guards: {sdc: {enabled_level: 2, strikes: 2, points: ["1", "4"]}}\n'
# the drill's module fault (docs/faults.md): the gradient into module 4 of the first micro-batch rank 1 computes
SCALE = "scale:rank=1,step={step},site=4,where=grad_input,factor=1e9"
TRANSIENT_AT, STRUCK_OUT_AT = 3, 5
SPIKE_POSITION, THRESHOLD = 4, 50.0
ROLLBACK = CONFIG + ("guards: {check_for_global_norm: true, skip: {threshold: %r}, "
                      "rollback: {window_before: 1, window_after: 1}}\n" % THRESHOLD)
WINDOW = (SPIKE_POSITION, SPIKE_POSITION + 2)  # the policy's steps 4-6 around the spiked step 5, past global_step_4
SKIP = CONFIG + "guards: {skip: {enabled: true, threshold: %r}}\n" % THRESHOLD
SKIPPED = [(3, True), (4, False)]  # (step, a NaN norm)
# rank 3 SIGSTOPped once rank 0 has committed step 1 (from 0), SIGCONTed once the launcher has recorded the stall
# (waited for at most STALL_WAIT_S). The bound is max(stall_s, stall_steps x the median step time): the default
# stall_steps keeps it above the pace of a machine loaded by the module's other runs (a 3-s bound alone took group 1
# out before the SIGSTOP once, in CI: a rank of a loaded run unscheduled for 3 s)
STOPPED, STOP_AFTER, STALL_WAIT_S = 3, 1, 120.0
# saved at the end only: the stall watch spans a step's collectives, not a durable save's (a rank stopped at a
# save's boundary is found by the heartbeat timeout: docs/live_recovery.md)
STOPPED_RUN = ("fault_tolerance.stall_s=3", f"checkpoint.save_interval={STEPS}")
# name: (configuration, --set items, the loop's flags), the first ones started first
GUARDED_RUNS = (
    {"sdc": (SDC, (), ()),
     "struck": (SDC, ("faults=" + "; ".join(SCALE.format(step=step) for step in (TRANSIENT_AT, STRUCK_OUT_AT)),), ()),
     "rolled": (ROLLBACK, (), ("--dropout", "0", "--spike-at", str(SPIKE_POSITION)))},
    {"unfed": (ROLLBACK, (), ("--dropout", "0", "--skip-window", ",".join(map(str, WINDOW)))),
     "faulted": (SKIP, ("faults=nan:step=3; bitflip:rank=1,step=4,site=1,where=grad_input",), ()),
     "replayed": (SKIP, (f"guards.skip.replay_steps={[step for step, _ in SKIPPED]}",), ())})


TRAINER = ("fault_tolerance.live=true", "fault_tolerance.fsdp=true", "parallel.dp_replicate=2", "parallel.dp_shard=1",
           "parallel.tp=2", "fault_tolerance.hang_s=60", "model.preset=llama-micro", "data.seq_len=32",
           "train.micro_batches=4", "data.micro_batch_size=2")


def _start_trainer(run_dir: Path, *overrides: str):
    sets = [arg for item in (*TRAINER, *overrides) for arg in ("--set", item)]
    return warm_server().start(["train", "--nproc", str(WORLD), "--run-dir", str(run_dir), "--steps", str(STEPS),
                                "--save-interval", "2", *sets], worker_env())


def _start(config: Path, run_dir: Path, *overrides: str, script: tuple[str, ...] = ()):
    sets = [arg for item in overrides for arg in ("--set", item)]
    return warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir), *sets,
                                "--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--config", str(config),
                                *script], worker_env())


def _guarded_starts(root: Path, wave: dict) -> dict:
    """Each guarded run of ``wave``: its name and how to start it (its configuration file written now)."""
    starts = {}
    for name, (text, overrides, script) in wave.items():
        config = root / f"{name}.yaml"
        config.write_text(text, encoding="utf-8")
        starts[name] = lambda config=config, name=name, overrides=overrides, script=script: _start(
            config, root / name, *overrides, script=script)
    return starts


def _stop_for_a_while(run_dir: Path, started: subprocess.Popen) -> None:
    """SIGSTOPs rank ``STOPPED``'s process once rank 0 has committed step ``STOP_AFTER`` (0-based), SIGCONTs it once
    the launcher has recorded a stall with it absent; the run goes on meanwhile."""
    deadline = time.monotonic() + 300
    while not (events_path(run_dir).exists() and [e for e in events_of(run_dir, "live_step")
                                                   if e["rank"] == 0 and e["step"] >= STOP_AFTER]):
        assert started.poll() is None and time.monotonic() < deadline, "the stopped run ended before its SIGSTOP"
        time.sleep(0.02)
    pid = [e["pid"] for e in events_of(run_dir, "live_start") if e["rank"] == STOPPED][-1]
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        raise AssertionError(f"rank {STOPPED} (pid {pid}) ended before its SIGSTOP; the run's stalls so far: "
                             f"{events_of(run_dir, 'live_stall')}") from None
    try:
        deadline = time.monotonic() + STALL_WAIT_S
        while not [e for e in events_of(run_dir, "live_stall") if STOPPED in e["absent"]]:
            assert time.monotonic() < deadline, f"no stall recorded {STALL_WAIT_S} s after rank {STOPPED}'s SIGSTOP"
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)


def _finish(name: str, proc) -> None:
    done = finish_session(proc, 300, f"live tp run {name}")
    assert done.returncode == 0, name + ": " + done.stdout[-3000:] + done.stderr[-3000:]


def _run(name: str, start, after: Future | None = None) -> None:
    """Starts a run once ``after`` (the run it continues) ended, and waits for it."""
    if after is not None:
        after.result()
    _finish(name, start())


def _stopped_run(run_dir: Path, config: Path) -> None:
    """The run whose rank ``STOPPED`` is SIGSTOPped for a while (``_stop_for_a_while``), waited for."""
    proc = _start(config, run_dir, *STOPPED_RUN, script=("--step-sleep", "0.1"))
    try:
        _stop_for_a_while(run_dir, proc)
    finally:
        _finish("stopped", proc)


# Runs at a time: as many as the first seven started together, each of 4 ranks
CONCURRENT = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_tp")
    config = root / "live_tp.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    first = {**{name: lambda name=name, overrides=overrides: _start(config, root / name, *overrides)
                for name, overrides in RUNS.items()}, **_guarded_starts(root, GUARDED_RUNS[0])}
    then = {"trainer": lambda: _start_trainer(root / "trainer"),
            "trainer killed": lambda: _start_trainer(root / "trainer_killed", f"faults=kill:rank={KILLED},step={KILL_AT}"),
            **_guarded_starts(root, GUARDED_RUNS[1])}
    warm_server()  # the session's server made here, not by several threads at once
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        done = {name: pool.submit(_run, name, start) for name, start in first.items()}
        done["stopped"] = pool.submit(_stopped_run, root / "stopped", config)
        done.update({name: pool.submit(_run, name, start) for name, start in then.items()})
        done["resumed, again"] = pool.submit(_run, "resumed, again", lambda: _start(config, root / "resumed"),
                                             after=done["resumed"])
        for future in done.values():
            future.result()
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


def _trained_differences(reference: Path, run: Path) -> dict[int, list[str]]:
    """Each rank's final parameters and optimizer state against the same rank's in ``reference``, bitwise."""
    found = {}
    for rank in range(WORLD):
        clean, other = final_tensors(reference, rank), final_tensors(run, rank)
        found[rank] = sorted(name for name in clean.keys() | other.keys()
                             if name not in clean or name not in other or not torch.equal(clean[name], other[name]))
    return {rank: names for rank, names in found.items() if names}


def test_sdc_with_tp_on_without_a_fault_detects_nothing_and_ends_bitwise_as_sdc_off(runs):
    [points] = events_of(runs / "sdc", "sdc_points")
    assert points["names"][:4] == ["1 (tp 0)", "4 (tp 0)", "1 (tp 1)", "4 (tp 1)"]
    assert "grad:0.weight (shard 1)" in points["names"]  # a parameter's gradient: each rank's local piece
    assert not [e for e in read_events(events_path(runs / "sdc")) if e["kind"].startswith("sdc_")
                and e["kind"] != "sdc_points"]
    assert _trained_differences(runs / "clean", runs / "sdc") == {}


def test_a_transient_fault_on_one_tp_rank_is_found_there_and_the_clean_rerun_used_bitwise(runs):
    run_dir = runs / "struck"
    detected = events_of(run_dir, "sdc_detected")
    assert {e["step"] for e in detected} == {TRANSIENT_AT, STRUCK_OUT_AT}
    # module points: tp rank 1's values only (the split activation's piece and the replicated one), computed by
    # rank 1; its tp peer's values of the same micro-batches were clean
    assert sorted((e["step"], e["point"], e["computed_by"], e["level"]) for e in detected
                  if not e["point"].startswith("grad:")) == [
        (step, point, [1], 1) for step in (TRANSIENT_AT, STRUCK_OUT_AT) for point in ("1 (tp 1)", "4 (tp 1)")]
    assert [(e["step"], e["verdict"], e["ranks"]) for e in events_of(run_dir, "sdc_rerun")] == [
        (TRANSIENT_AT, "transient", [1]), (STRUCK_OUT_AT, "faulty", [1])]
    assert [(e["step"], e["rank"], e["attribution"], e["strikes"], e["faulty"])
            for e in events_of(run_dir, "sdc_attribution")] == [
        (TRANSIENT_AT, 1, "transient", 1, False), (STRUCK_OUT_AT, 1, "transient", 2, True)]
    assert not [e for e in events_of(run_dir, "live_step") if e["skipped"]]
    assert _trained_differences(runs / "sdc", run_dir) == {}
    assert _trained_differences(runs / "clean", run_dir) == {}


def test_a_tp_rank_reaching_its_strikes_exits_17_with_its_entry_and_its_group_is_replaced(runs):
    run_dir = runs / "struck"
    assert sorted((e["target"], e["code"]) for e in events_of(run_dir, "live_exit")) == [(0, GROUP_OUT_EXIT), (1, 17)]
    [entry] = json.loads(faulty_ranks_path(run_dir).read_text())
    assert (entry["rank"], entry["local_device"], [s["step"] for s in entry["strikes"]]) == (
        1, "cpu:1", [TRANSIENT_AT, STRUCK_OUT_AT])
    assert {e["rank"] for e in events_of(run_dir, "live_joined")} == {0, 1}
    degraded = {e["step"] for e in events_of(run_dir, "live_step") if e["members"] == 2}
    assert degraded and min(degraded) == STRUCK_OUT_AT  # live_step counts from 0: step 6 by group 1 alone


def test_a_spike_with_tp_rolls_every_rank_back_and_ends_bitwise_as_the_run_never_fed_the_window(runs):
    run_dir = runs / "rolled"
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["skipped"]) == (SPIKE_POSITION + 1, SPIKE_POSITION, [list(WINDOW)])
    for rank in range(WORLD):
        assert [e["step"] for e in events_of(run_dir, "live_step") if e["rank"] == rank] == list(range(STEPS)), rank
    assert not events_of(runs / "unfed", "rollback")
    assert _trained_differences(runs / "unfed", run_dir) == {}


def test_a_nan_and_one_tp_ranks_bitflip_are_skipped_and_end_bitwise_as_the_replayed_skips(runs):
    run_dir = runs / "faulted"
    assert [(e["step"], e["nan"]) for e in events_of(run_dir, "data_skip")] == SKIPPED
    [flipped] = [e for e in events_of(run_dir, "fault_injected") if e["fault"] == "bitflip"]
    assert (flipped["rank"], flipped["step"]) == (1, 4)
    for rank in range(WORLD):
        skipped = sorted({e["step"] + 1 for e in events_of(run_dir, "live_step") if e["rank"] == rank and e["skipped"]})
        assert skipped == [step for step, _ in SKIPPED], rank
    assert _trained_differences(runs / "replayed", run_dir) == {}


def test_a_tp_rank_sigstopped_mid_run_takes_its_group_out_at_the_stall_bound_and_it_rejoins_after_sigcont(runs):
    """The stopped rank's tp peer waits in a tp collective with it, silent (tp's collectives are not watched);
    the stall watch excludes group 1 and group 0 goes on alone; after SIGCONT both ranks of group 1 find their
    epoch ended, exit 20 and start again, and rejoin: the end state is the fault-free run's bitwise."""
    run_dir = runs / "stopped"
    assert [e["excluded"] for e in events_of(run_dir, "live_stall") if STOPPED in e["absent"]] == [[2, 3]]
    assert {0, 1} <= {e["rank"] for e in events_of(run_dir, "live_resumed")}
    assert {e["rank"] for e in events_of(run_dir, "live_step") if e["members"] == 2} == {0, 1}  # group 0 went on
    exits = {(e["target"], e["code"]) for e in events_of(run_dir, "live_exit")}
    assert exits >= {(2, GROUP_OUT_EXIT), (3, GROUP_OUT_EXIT)}
    assert not events_of(run_dir, "live_hung")
    assert {e["rank"] for e in events_of(run_dir, "live_joined")} == {2, 3}
    assert _trained_differences(runs / "clean", run_dir) == {}
