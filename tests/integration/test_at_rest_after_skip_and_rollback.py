"""The every-step at-rest check (issue 39) stays on across steps that change the state in other ways than
an update: a skipped step (the state did not change: the sums of the last update still hold) and a
rollback (the state loaded is the reference). One process (tests/helpers/at_rest_loop.py): the loop
flips a bit of the weight right after such a step, and the next step must find exactly that tensor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.runs import events, worker_env

LOOP = Path(__file__).resolve().parents[1] / "helpers" / "at_rest_loop.py"
STEPS = 8
SKIP = ["--set", "guards.skip.enabled=true", "--set", "guards.skip.threshold=10.0"]
ROLLBACK = ["--set", "guards.check_for_global_norm=true", "--set", "guards.skip.threshold=10.0",
            "--set", "guards.rollback.window_before=0", "--set", "guards.rollback.window_after=0"]


def run_loop(run_dir: Path, spike_step: int, flip_after: str, *overrides: str) -> subprocess.CompletedProcess:
    """Saves every 2 steps; the spiked gradient's norm is 1e4 times a clean one's, far above the threshold."""
    return subprocess.run([sys.executable, str(LOOP), str(run_dir), str(STEPS), "--flip-after", flip_after,
                           "--set", "checkpoint.save_interval=2", "--set", "checkpoint.async_save=false",
                           *overrides], env=worker_env(TRAINGUARD_FAULTS=f"spike:step={spike_step}"),
                          capture_output=True, text=True, timeout=300)


def mismatches(run_dir: Path) -> list[tuple[int, list[str], list[str]]]:
    return [(e["step"], e["tensors"], e["how"]) for e in events(run_dir, "fingerprint_mismatch")]


def test_a_flip_right_after_a_skipped_step_is_found_at_the_next_step(tmp_path):
    """The sums were keyed by the step of the last update: after a skipped step no key matched and the
    flip went into the next update unseen, every later save committed healthy."""
    run_dir = tmp_path / "run"
    proc = run_loop(run_dir, 5, "skipped", *SKIP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["step"] for e in events(run_dir, "data_skip")] == [5]
    assert mismatches(run_dir) == [(6, ["param:weight"], ["at_rest"])]
    assert [(e["step"], e["to_step"]) for e in events(run_dir, "fingerprint_recompute")] == [(6, 4)]


def test_a_flip_right_after_a_rollback_is_found_and_the_state_loaded_is_no_false_alarm(tmp_path):
    """Rollback mode took no sums of the state it loaded: back from step 6 to global_step_4, the sums
    were step 5's, and the check was off for the next step (compared with them, every tensor would have
    looked changed)."""
    run_dir = tmp_path / "run"
    proc = run_loop(run_dir, 6, "rolled_back", *ROLLBACK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(e["step"], e["to_step"]) for e in events(run_dir, "rollback")] == [(6, 4)]
    assert mismatches(run_dir) == [(5, ["param:weight"], ["at_rest"])]
