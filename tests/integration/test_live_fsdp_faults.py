"""Rollback mode and the drill's faults (gradient, module, hang, checkpoint file) in live mode with FSDP2
inside each replica group (issue 35, item 3): tests/integration/live_fsdp_loop.py (the tiny MLP sharded with ``fully_shard`` over
``trainguard.data_parallel_mesh()``), 2 replica groups x 2 ranks, 8 micro-batches, AdamW with the default
clipping, 10 steps, durable checkpoints every 3 steps. Eight runs, six started together by one module fixture,
then the hang's and a resume, one at a time:

- rollback mode (``guards.check_for_global_norm``; dropout off): the loss of data position 6 multiplied by
  10^4 every time it is fed; step 7 spikes, every rank restores ``global_step_6`` (DCP of the DTensor shards),
  the window skips data positions [6, 8), and the run ends bitwise equal (every rank's final parameters and
  optimizer state) to the same configuration run on data that never had positions 6 and 7
  (``--skip-window 6,8``). Dropout is off in this pair because the worker seeds a micro-batch's random
  draws from its data position, which a script feeding other positions cannot move; the same run with rank 3
  SIGKILLed after the rollback (as it starts step 8): group 1 out, back with a live peer's state, the skipped
  window included, and the whole final state is the unkilled run's bitwise;
- data skip on (dropout on), the drill's gradient faults (``spike:step=4``, ``nan:step=7``) and module faults in
  one rank's share (``bitflip`` of the gradient into module 3 on rank 0 at step 2, ``scale`` of the gradient
  into module 5 on rank 1 at step 5): the four steps skipped by every rank, and every rank's final parameters
  and optimizer state bitwise those of a fault-free run skipping steps 2, 4, 5 and 7 by replay
  (``guards.skip.replay_steps``);
- the same run with ``hang:rank=1,step=6`` besides: rank 1 stops as it starts step 6, inside its group's
  share; the stall watch takes group 0 out, group 1 goes on alone, the lighthouse finds rank 1 hung and the
  launcher kills it; rank 0's FSDP2 wait ends once rank 1 is killed (not at gloo's timeout), it exits 20
  (``live_group_out``), both ranks start again and join, and every rank ends with the spiked run's state;
- the replayed run stopped at step 9 (``train.exit_at_step``), the drill's ``corrupt:step=9`` damaging its
  DCP shards' files once committed, then run again with ``--resume auto``: ``global_step_9`` is passed over
  (checksum mismatch), the run resumes from ``global_step_6`` and ends bitwise equal to the replayed run.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.runs import events as events_of, finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.live.compare import bitwise_differences, run_differences
from trainguard.live.files import final_path
from trainguard.live.rank import GROUP_OUT_EXIT

SCRIPT = Path(__file__).with_name("live_fsdp_loop.py")
STEPS, WORLD, SPIKE_POSITION, THRESHOLD = 10, 4, 6, 50.0
TIMEOUT_S = 300
BASE = """fault_tolerance: {live: true, fsdp: true}
parallel: {dp_replicate: 2, dp_shard: 2}
train: {micro_batches: 8, steps: %d}
checkpoint: {save_interval: 3}
""" % STEPS
ROLLBACK = BASE + ("guards: {check_for_global_norm: true, skip: {threshold: %r}, "
                   "rollback: {window_before: 1, window_after: 1}}\n" % THRESHOLD)
SKIP = BASE + "guards: {skip: {enabled: true, threshold: %r}}\n" % THRESHOLD
# a bit of the gradient into module 3 flipped in rank 0's share of step 2 (0.0082 became 5.9e36), every gradient
# spiked at step 4, the gradient into module 5 scaled in rank 1's share of step 5, a NaN planted at step 7
GRADIENT_FAULTS = ("faults=bitflip:rank=0,step=2,site=3,where=grad_input; spike:step=4,factor=10000; "
                   "scale:rank=1,step=5,site=5,where=grad_input,factor=1000000; nan:step=7")
SKIPPED = [(2, False), (4, False), (5, False), (7, True)]  # (step, a NaN norm)
REPLAY = f"guards.skip.replay_steps={[step for step, _ in SKIPPED]}"
HANG = "hang:rank=1,step=6"
# the rollback window [6, 8): the policy's steps 6-8 around the spiked step 7, moved past global_step_6
WINDOW = (SPIKE_POSITION, SPIKE_POSITION + 2)
# 16 ranks starting together on a small machine can be silent for longer than the default 10 s: the heartbeat
# timeout of the runs that drill no hang is long (it changes no result)
PATIENT = "fault_tolerance.hang_s=60"
RESUMED = ("stopped", "resumed")  # one run directory: a stop, and the resume that follows it
# name: (configuration, --set items, the script's flags)
RUNS = {
    "rolled": (ROLLBACK, (PATIENT,), ("--dropout", "0", "--spike-at", str(SPIKE_POSITION))),
    "unfed": (ROLLBACK, (PATIENT,), ("--dropout", "0", "--skip-window", ",".join(map(str, WINDOW)))),
    # rank 3 SIGKILLed as it starts step 8, after the rollback: its group rejoins with the skipped window
    "rolled_killed": (ROLLBACK, (PATIENT, "faults=kill:rank=3,step=8"),
                      ("--dropout", "0", "--spike-at", str(SPIKE_POSITION))),
    "faulted": (SKIP, (GRADIENT_FAULTS, PATIENT), ()),
    "replayed": (SKIP, (REPLAY, PATIENT), ()),
    # the replayed run stopped at step 9 (saved), its checkpoint damaged by the drill, then resumed: from step 6
    "stopped": (SKIP, (REPLAY, PATIENT, "train.exit_at_step=9", "faults=corrupt:step=9,file=*.distcp"), ()),
    "resumed": (SKIP, (REPLAY, PATIENT), ()),
    # run alone after the others; the stall watch and the heartbeat timeout short: the hung rank costs seconds
    # gloo's timeout longer than the test's: a rank left waiting for it would fail the test
    "hung": (SKIP, (f"{GRADIENT_FAULTS}; {HANG}", "fault_tolerance.stall_s=2", "fault_tolerance.hang_s=6",
                    f"fault_tolerance.collective_timeout_s={2 * TIMEOUT_S}"), ()),
}


def _start(root: Path, name: str) -> subprocess.Popen:
    text, sets, flags = RUNS[name]
    config = root / f"{name}.yaml"
    config.write_text(text, encoding="utf-8")
    args = [arg for item in sets for arg in ("--set", item)]
    run_dir = root / (RESUMED[0] if name in RESUMED else name)
    return warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir),
                                *args, "--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--config",
                                str(config), *flags], worker_env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("live_fsdp_faults")
    together = [name for name in RUNS if name not in ("hung", "resumed")]
    started = {name: _start(root, name) for name in together}
    done = {name: finish_session(proc, TIMEOUT_S, f"the live FSDP2 run {name}") for name, proc in started.items()}
    for name in ("hung", "resumed"):  # one at a time: a short heartbeat timeout, and the stopped run's sequel
        done[name] = finish_session(_start(root, name), TIMEOUT_S, f"the live FSDP2 run {name}")
    for name, finished in done.items():
        assert finished.returncode == 0, name + ": " + finished.stdout[-3000:] + finished.stderr[-3000:]
    return root, done


def _trained_differences(reference: Path, run: Path) -> dict[int, list[str]]:
    """Each rank's final parameters and optimizer state against the same rank's in ``reference``, bitwise (the
    guards' state differs by design: a rollback or a skip counted in one, not in the other)."""
    found = {}
    for rank in range(WORLD):
        states = [safe_torch_load(final_path(run_dir, rank)) for run_dir in (reference, run)]
        found[rank] = bitwise_differences(*({"model": s["model"], "optimizer": s["optimizer"]} for s in states))
    return {rank: where for rank, where in found.items() if where}


def _committed_steps(run_dir: Path) -> list[int]:
    return [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed]


def test_a_spike_on_fsdp2_rolls_every_rank_back_and_ends_bitwise_as_the_run_never_fed_the_window(runs):
    root, done = runs
    run_dir = root / "rolled"
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["window"], event["skipped"]) == (
        SPIKE_POSITION + 1, SPIKE_POSITION, [SPIKE_POSITION + 1, SPIKE_POSITION + 2], [list(WINDOW)])
    for rank in range(WORLD):
        steps = [e["step"] for e in events_of(run_dir, "live_step") if e["rank"] == rank]
        assert steps == list(range(STEPS)), rank  # the spiked step 6 (from 0) not committed, then trained again
    # the loop is told rolled_back, with the restored step, on every rank
    assert all(f"rank {rank}: rolled back to step {SPIKE_POSITION}" in done["rolled"].stdout for rank in range(WORLD))
    assert _committed_steps(run_dir) == _committed_steps(root / "unfed") == [6, 9, 10]  # checkpoint.keep_last 3
    assert not events_of(root / "unfed", "rollback")
    assert _trained_differences(root / "unfed", run_dir) == {}


def test_an_fsdp2_group_lost_after_the_rollback_rejoins_with_the_skipped_window_and_ends_bitwise(runs):
    root, _ = runs
    run_dir = root / "rolled_killed"
    assert len(events_of(run_dir, "rollback")) == 1
    assert [e["rank"] for e in events_of(run_dir, "live_group_out")] == [2]
    assert {e["rank"] for e in events_of(run_dir, "live_joined")} == {2, 3}
    assert run_differences(root / "rolled", run_dir, WORLD) == {}  # the guards' state (the window) included


@pytest.mark.parametrize("run", ["faulted", "hung"])
def test_gradient_and_module_faults_on_fsdp2_are_skipped_and_the_run_ends_bitwise_as_the_replayed_skips(runs, run):
    root, _ = runs
    run_dir = root / run
    skips = events_of(run_dir, "data_skip")  # one report each, by the quorum's first member
    assert [(e["step"], e["nan"]) for e in skips] == SKIPPED
    # live_step counts from 0: index 3 is the closure mode's step 4; in the hung run group 0 is out at step 7
    for rank in range(WORLD) if run == "faulted" else (2, 3):
        steps = [e for e in events_of(run_dir, "live_step") if e["rank"] == rank]
        assert sorted({e["step"] + 1 for e in steps if e["skipped"]}) == [step for step, _ in SKIPPED], rank
    assert _trained_differences(root / "replayed", run_dir) == {}


def test_a_hung_fsdp2_rank_takes_its_group_out_which_rejoins_and_the_run_ends_bitwise(runs):
    root, done = runs
    run_dir = root / "hung"
    [fired] = [e for e in events_of(run_dir, "fault_injected") if e["fault"] == "hang"]
    assert (fired["rank"], fired["step"], fired["action"]) == (1, 6, "hang")
    assert [e["target"] for e in events_of(run_dir, "live_hung")] == [1]
    # rank 0 waited in its group's FSDP2 collective until rank 1 was found hung and killed (its fence, or the
    # connection closed), not until gloo's timeout (longer than the test's here)
    [hung_at] = [e["time"] for e in events_of(run_dir, "live_hung")]
    failed = [e for e in events_of(run_dir, "live_collective_failed") if e["rank"] == 0]
    assert [e["epoch"] for e in failed] == [0] and failed[0]["time"] >= hung_at, failed
    assert [e["rank"] for e in events_of(run_dir, "live_group_out")] == [0]
    assert {(e["target"], e["code"]) for e in events_of(run_dir, "live_exit")} == {(1, -9), (0, GROUP_OUT_EXIT)}
    pids = defaultdict(list)
    for event in events_of(run_dir, "live_start"):
        pids[event["rank"]].append(event["pid"])
    assert len(pids[0]) == len(pids[1]) == 2 and len(pids[2]) == len(pids[3]) == 1
    degraded = [e for e in events_of(run_dir, "live_step") if e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {2, 3}  # group 1 computed both groups' shares
    assert {e["rank"] for e in events_of(run_dir, "live_joined")} == {0, 1}
    assert run_differences(root / "faulted", run_dir, WORLD) == {}


def test_a_damaged_fsdp2_checkpoint_is_passed_over_at_the_resume_which_ends_bitwise(runs):
    root, done = runs
    run_dir = root / RESUMED[0]
    [damaged] = [e for e in events_of(run_dir, "fault_injected") if e["fault"] == "corrupt"]
    assert damaged["step"] == 9 and damaged["files"]
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'global_step_9'}: " in done["resumed"].stderr + \
        done["resumed"].stdout
    assert [e["step"] for e in events_of(run_dir, "run_started") if e.get("resumed_from")] == [6]
    assert run_differences(root / "replayed", run_dir, WORLD) == {}
