"""The supervisor on real multi-process runs: restarts after a killed rank and a hang, crash loops,
node exclusion with a spare, and the lifecycle stops (kill switch, SIGUSR1)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from helpers.runs import TINY, assert_same_tensors, events, ok, train, trainguard, worker_env
from helpers.warm_command import WarmProcess, warm_server
from trainguard.runtime.heartbeat import read_heartbeats

STEPS = 8  # the committed_run fixture: 2 ranks, 8 steps, saves every 4


@pytest.fixture(scope="module")
def disturbed(tmp_path_factory):
    """The committed_run configuration under the supervisor, with rank 0 hung at step 6, then (after
    the restart from step 4) rank 1 SIGKILLed at step 7."""
    run = tmp_path_factory.mktemp("disturbed") / "run"
    proc = train(run, 2, STEPS, "--save-interval", "4", "--max-restarts", "3", "--hang-timeout", "8",
                 faults="kill:rank=1,step=7;hang:rank=0,step=6", timeout=600)
    return run, proc


def test_killed_rank_restarts_and_ends_bitwise_equal_to_an_undisturbed_run(committed_run, disturbed):
    run, proc = ok(disturbed[1]) and disturbed
    killed = [e for e in events(run, "restart") if e["reason"] == "failed"]
    assert len(killed) == 1 and (killed[0]["failing_rank"], killed[0]["failing_node"]) == (1, "node0")
    assert "SIGKILL" in killed[0]["detail"] or "killed" in killed[0]["detail"]
    finished = events(run, "run_finished")
    assert finished[-1]["step"] == STEPS
    assert_same_tensors(committed_run / f"checkpoints/global_step_{STEPS}", run / f"checkpoints/global_step_{STEPS}")


def test_hang_is_detected_dumped_for_every_rank_and_restarted(disturbed):
    run, proc = disturbed
    hangs = events(run, "hang_detected")
    assert len(hangs) == 1 and hangs[0]["ranks_dumped"] == [0, 1]
    assert hangs[0]["suspect_ranks"] == [0]  # rank 1 waits in a collective for rank 0
    dumps = run / "hangs" / f"incarnation_{hangs[0]['incarnation']}"
    rank0, rank1 = (dumps / "rank_0.txt").read_text(), (dumps / "rank_1.txt").read_text()
    assert "in _hang" in rank0 and "faults/injector.py" in rank0
    assert "torch/distributed" in rank1
    assert [e["reason"] for e in events(run, "restart")] == ["hang", "failed"]
    assert events(run, "supervisor_finished")[-1]["exit_code"] == 0


def test_every_recovery_is_measured(disturbed):
    run, _ = disturbed
    recovered = events(run, "recovered")
    assert [r["reason"] for r in recovered] == ["hang", "failed"]
    for r in recovered:
        assert set(r["parts"]) == {"detection", "restart", "process_start", "init", "checkpoint_load", "first_step"}
        assert all(v is not None and v >= 0 for v in r["parts"].values())
        assert r["steps_redone"] >= 0 and r["trainguard_seconds"] <= r["seconds"]
    assert recovered[0]["steps_redone"] == 5 - 4  # hung in step 6 after completing 5; resumed at 4
    assert recovered[1]["steps_redone"] == 6 - 4  # died in step 7 after completing 6; resumed at 4


def test_crash_loop_gives_up_with_a_summary(tmp_path):
    run = tmp_path / "run"
    proc = train(run, 2, 6, "--save-interval", "2", "--max-restarts", "5", "--backoff", "0",
                 faults="kill:rank=0,step=3,persistent=1", timeout=600)
    assert proc.returncode == 1
    assert "giving up: crash loop" in proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("trainguard supervisor:   #")]
    assert len(summary) == 3 and all("reached_step=2" in line and "failed" in line for line in summary)
    gave_up = events(run, "supervisor_gave_up")
    assert len(gave_up) == 1 and len(gave_up[0]["incarnations"]) == 3
    assert len(events(run, "restart")) == 2


def test_an_error_that_ends_a_rank_at_start_up_reaches_the_terminal_as_one_line(tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the local tier's directory should go")
    proc = train(tmp_path / "run", 2, 2, "--set", "checkpoint.local_interval=1",
                 "--set", f"checkpoint.local_dir={blocker}/{{node}}", timeout=300)
    assert proc.returncode == 1
    said = [line for line in proc.stderr.splitlines() if "NotADirectoryError" in line]
    assert len(said) == 1, proc.stderr
    assert said[0].startswith("trainguard supervisor: incarnation 0: rank ")
    assert str(blocker) in said[0] and "failed (exit 1): NotADirectoryError: " in said[0]
    ended = events(tmp_path / "run", "incarnation_ended")[-1]
    assert "NotADirectoryError" in ended["detail"]


def test_faulty_node_is_excluded_and_a_spare_keeps_the_world_size(tmp_path):
    """node1's device miscomputes persistently (exit 17): excluded; the first spare, node2, fails its
    self-test (trainguard doctor, a miscomputed burn-in repetition): excluded too; node3 takes the slot."""
    run = tmp_path / "run"
    fault = ("bitflip:rank=1,node=node1,step=3,site=model.layers.1.input_layernorm,where=grad_input,persistent=1;"
             "miscompute:rep=1,node=node2")
    proc = ok(train(run, 1, 8, "--nnodes", "2", "--spare-nodes", "2", "--doctor", "--max-restarts", "2",
                    "--save-interval", "8", "--set", "guards.sdc.enabled_level=2", faults=fault, timeout=600))
    assert "node node1 excluded" in proc.stderr and "spare node node2 failed its self-test" in proc.stderr
    assert "spare node node3 takes the slot of node1" in proc.stderr
    ended = events(run, "incarnation_ended")
    assert [(e["nodes"], e["exit_code"]) for e in ended] == [(["node0", "node1"], 17), (["node0", "node3"], 0)]
    assert (ended[0]["failing_rank"], ended[0]["failing_node"]) == (1, "node1")
    excluded = events(run, "node_excluded")
    assert [(e["node"], e["reason"]) for e in excluded] == [("node1", "faulty_hardware"), ("node2", "doctor")]
    assert "burn-in" in excluded[1]["detail"]
    assert [e["kind"] for e in events(run) if e["kind"].startswith("doctor_")] == ["doctor_failed", "doctor_passed"]
    assert [e["node"] for e in json.loads((run / "nodes/excluded.json").read_text())] == ["node1", "node2"]
    beats = read_heartbeats(run)
    assert {rank: beat.node for rank, beat in beats.items()} == {0: "node0", 1: "node3"}
    manifest = json.loads((run / "checkpoints/global_step_8/trainguard.json").read_text())
    assert manifest["world_size"] == 2
    assert events(run, "run_finished")[-1]["step"] == 8


def _start(run, steps: int, *extra: str) -> WarmProcess:
    return warm_server().start(["train", "--nproc", "2", "--steps", str(steps), "--run-dir", str(run),
                                "--save-interval", "0", *TINY, *extra], worker_env())


def _wait_for_step(run, step: int, proc: WarmProcess) -> None:
    """Until both ranks' heartbeats say they completed ``step`` (or later)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        beats = read_heartbeats(run).values()
        if len(beats) == 2 and all(b.phase in ("step", "save") and b.step >= step for b in beats):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step} (exit {proc.poll()})")


def test_sigusr1_saves_and_exits_16_then_the_kill_switch_stops_the_resumed_run(tmp_path):
    run, switch = tmp_path / "run", tmp_path / "kill-switch"
    steps = 400  # never reached: the run is stopped long before
    common = ("--set", f"lifecycle.kill_switch_path={switch}")

    first = _start(run, steps, *common)
    _wait_for_step(run, 3, first)
    os.kill(first.pid, signal.SIGUSR1)  # as Slurm's --signal=USR1@90 would: the supervisor tells every rank
    out, err = first.communicate(timeout=300)
    assert first.returncode == 16, err[-2000:]
    stop = events(run, "lifecycle_stop")
    assert len(stop) == 1 and stop[0]["reason"] == "signal" and stop[0]["exit_code"] == 16
    stopped_at = stop[0]["step"]
    assert stop[0]["last_checkpoint"] == stopped_at and (run / f"checkpoints/global_step_{stopped_at}").is_dir()
    assert {b.step for b in read_heartbeats(run).values()} == {stopped_at}  # every rank stopped after the same step

    second = _start(run, steps, *common)
    _wait_for_step(run, stopped_at + 2, second)
    assert events(run, "run_started")[-1]["step"] == stopped_at  # resumed from the signal's checkpoint
    ok(trainguard("killswitch", str(switch)))
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    stop = events(run, "lifecycle_stop")[-1]
    assert stop["reason"] == "kill_switch" and stop["exit_code"] == 0 and stop["step"] > stopped_at
    assert (run / f"checkpoints/global_step_{stop['step']}").is_dir()

    steps_before = len(events(run, "step"))
    third = _start(run, steps, *common)
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0
    assert events(run, "lifecycle_stop")[-1]["reason"] == "kill_switch"
    assert len(events(run, "step")) == steps_before and len(events(run, "run_started")) == 2  # nothing loaded or run


def test_exit_duration_already_reached_exits_16_without_training(tmp_path):
    run = tmp_path / "run"
    proc = train(run, 2, 4, "--set", "lifecycle.exit_duration_in_mins=0.0001")
    assert proc.returncode == 16
    stop = events(run, "lifecycle_stop")
    assert stop[0]["reason"] == "exit_duration" and events(run, "step") == []
