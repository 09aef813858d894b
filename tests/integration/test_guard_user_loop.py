"""trainguard.Guard in a user's own loop (tests/helpers/guard_loop.py: a tiny Qwen2, FSDP2, 2 gloo ranks),
launched by plain torchrun: killed and resumed it ends bitwise equal to a run that never stopped; a
gradient spike is skipped; a persistent spike aborts with exit 3 from inside guard.step, and every
rank's heartbeat records that intended exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import assert_same_tensors, events, launched_fixture, succeeded, torchrun, worker_env

LOOP = Path(__file__).resolve().parents[1] / "helpers" / "guard_loop.py"
STEPS = 6
TIMEOUT_S = 300
SKIP = ["--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=100"]


def run_loop(run_dir: Path, *overrides: str, faults: str | None = None) -> subprocess.CompletedProcess:
    return torchrun(LOOP, "--run-dir", str(run_dir), "--steps", str(STEPS), "--set", "checkpoint.save_interval=2",
                    "--set", "checkpoint.async_save=false", *overrides,
                    env=worker_env(**({"TRAINGUARD_FAULTS": faults} if faults else {})), timeout=TIMEOUT_S)


def outcomes(output: str) -> dict[int, str]:
    return {int(line.split()[1].split("=")[1]): line for line in output.splitlines() if line.startswith("outcome ")}


def killed_then_resumed(run_dir: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return run_loop(run_dir, faults="kill:rank=1,step=5"), run_loop(run_dir)


def stopped_armed_finished(run_dir: Path) -> dict:
    """Stopped by ``train.exit_at_step=3``, started with the kill switch armed (its last ``lifecycle_stop``
    event and ``trainguard status`` read then), disarmed and run to the end."""
    kill_switch = run_dir.parent / f"{run_dir.name}.STOP"
    first = run_loop(run_dir, "--set", "train.exit_at_step=3")
    kill_switch.touch()
    armed = run_loop(run_dir, "--set", f"lifecycle.kill_switch_path={kill_switch}")
    stop = events(run_dir, "lifecycle_stop")[-1]
    status = subprocess.run([sys.executable, "-m", "trainguard", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    kill_switch.unlink()
    return {"first": first, "armed": armed, "stop": stop, "status": status, "rest": run_loop(run_dir)}


CHAINS = {  # name: the launches of one test, in order, in a directory of their own named after it; longest first
    "closed": stopped_armed_finished,
    "killed": killed_then_resumed,
    "straight": run_loop,
    "spiked": lambda run_dir: run_loop(run_dir, *SKIP, faults="spike:step=3,factor=1e4"),
    "aborted": lambda run_dir: run_loop(run_dir, *SKIP, "--set", "guards.skip.count_threshold=2",
                                        faults="spike:step=3,factor=1e4,persistent=1"),
}
launched = launched_fixture("guard_loop", CHAINS)  # two at a time (helpers/runs.py's launch_together)


@pytest.fixture(scope="module")
def straight(launched) -> Path:
    return succeeded(launched["straight"])


def test_killed_and_resumed_user_loop_is_bitwise_identical(straight, launched):
    run_dir, (killed, resumed) = launched["killed"].result()
    assert killed.returncode != 0 and 5 not in outcomes(killed.stdout), killed.stdout[-3000:]
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert sorted(outcomes(resumed.stdout)) == [5, 6]  # continued after the checkpoint of step 4
    assert assert_same_tensors(straight / "checkpoints" / "global_step_6", run_dir / "checkpoints" / "global_step_6")
    assert [e["step"] for e in events(run_dir, "run_started")] == [0, 4]
    assert [e["reason"] for e in events(run_dir, "run_finished")] == ["finished"]
    # the guard wrote huggingface/ from the loop's Qwen2 config
    hf = json.loads((run_dir / "checkpoints" / "global_step_6" / "huggingface" / "config.json").read_text())
    assert hf["model_type"] == "qwen2"


def test_a_spike_is_skipped_in_a_user_loop(straight, launched):
    run_dir, proc = launched["spiked"].result()
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = outcomes(proc.stdout)
    assert "skipped=True applied=False" in lines[3]
    assert all("skipped=False applied=True" in lines[s] for s in (1, 2, 4, 5, 6))
    assert [e["step"] for e in events(run_dir, "data_skip")] == [3]
    assert [e["skipped"] for e in events(run_dir, "step")] == [False, False, True, False, False, False]
    clean = {e["step"]: e["global_norm"] for e in events(straight, "step")}
    spiked = {e["step"]: e["global_norm"] for e in events(run_dir, "step")}
    assert spiked[2] == clean[2] and spiked[3] > 1000 * clean[3]


def test_persistent_spikes_abort_inside_guard_step_with_exit_3(launched):
    run_dir, proc = launched["aborted"].result()
    assert proc.returncode != 0
    assert "trainguard: error: [rank 0] ValueError: Current global norm" in proc.stdout, proc.stdout[-3000:]
    assert [e["step"] for e in events(run_dir, "data_skip_abort")] == [4]
    beats = [json.loads(p.read_text()) for p in sorted((run_dir / "heartbeats").glob("rank_*.json"))]
    assert [(b["phase"], b["step"], b["exit_code"]) for b in beats] == [("exit", 3, 3)] * 2


def test_close_returns_0_three_ways_and_outcome_tells_them_apart(launched):
    """Issue 38 item 8: train.exit_at_step, a start with the kill switch armed, and the finished run all
    exit 0; only the last may be exported. After the no-op start, status names the run's step, not 0."""
    _, runs = launched["closed"].result()
    first, armed, stop, status, rest = (runs[key] for key in ("first", "armed", "stop", "status", "rest"))
    assert "run outcome=exit_at_step finished=False code=0" in first.stdout, first.stdout[-4000:]
    assert armed.returncode == 0 and "run outcome=not_started finished=False code=0" in armed.stdout, armed.stdout[-4000:]
    assert (stop["step"], stop["outcome"], stop["last_checkpoint"]) == (3, "not_started", 3)
    state = next(line.strip() for line in status.stdout.splitlines() if line.strip().startswith("state"))
    assert "kill switch armed at start, nothing trained (exit 0; the run is at step 3)" in state, status.stdout
    assert "run outcome=finished finished=True code=0" in rest.stdout, rest.stdout[-4000:]
