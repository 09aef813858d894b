"""Live runs as a newcomer starts them, following docs/cli.md. ``trainguard train`` in live mode: one small
live run (2 replica groups of 1 rank, llama-micro, 2 steps, a durable checkpoint at step 2) shared by the
module, then what happens next in that directory:

- ``trainguard status`` on it shows the last committed step's loss and global norm (live runs write
  ``live_step`` events, no ``step`` events).
- another model's live run in the same directory (mistral-micro: the newest checkpoint does not fit it):
  one line naming the checkpoint and the mismatch, exit 2, no rank replaced, the checkpoint untouched.

``trainguard run``'s live path (tests/helpers/live_loop.py, 2 replica groups of 2 ranks) with a
configuration error that every rank's ``Guard`` finds: printed once, by the run's rank 0 (each replica
group's first rank is rank 0 of its own process group), and each rank's heartbeat records exit 2.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

from helpers.runs import trainguard
from trainguard.runtime.heartbeat import read_heartbeats
from trainguard.events.log import read_events

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
LIVE = ["fault_tolerance.live=true", "parallel.dp_replicate=2", "data.seq_len=32", "train.micro_batches=2",
        f"checkpoint.save_interval={STEPS}"]


def live_train(run_dir: Path, preset: str):
    return trainguard("train", "--nproc", "2", "--steps", str(STEPS), "--run-dir", str(run_dir),
                      *[arg for item in [*LIVE, f"model.preset={preset}"] for arg in ("--set", item)], timeout=300)


def file_digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("live_run_dir") / "run"
    result = live_train(run_dir, "llama-micro")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_status_shows_the_last_committed_steps_loss_and_norm(run_dir):
    last = [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "live_step" and e["step"] == STEPS - 1]
    assert last, "the live run wrote no live_step event of its last step"
    result = trainguard("status", str(run_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in result.stdout.splitlines() if line.strip())
    assert rows["step"] == str(STEPS)
    assert rows["loss"] == f"{last[-1]['loss']:.4f}" and rows["global norm"] == f"{last[-1]['global_norm']:.4g}"


def test_another_models_live_run_in_the_directory_ends_with_one_line_and_exit_2(run_dir):
    checkpoints = run_dir / "checkpoints"
    before = file_digests(checkpoints)
    events_before = len(list(read_events(run_dir / "events.jsonl")))
    result = live_train(run_dir, "mistral-micro")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"{checkpoints / f'global_step_{STEPS}'}" in errors[0]
    assert "does not fit this run's model" in errors[0] and "Missing key" in errors[0]
    kinds = [event["kind"] for event in list(read_events(run_dir / "events.jsonl"))[events_before:]]
    assert "live_replacement" not in kinds and "live_exit" not in kinds
    assert file_digests(checkpoints) == before


def test_a_config_error_every_live_rank_finds_is_printed_once(tmp_path):
    run_dir = tmp_path / "run"
    result = trainguard("run", "--nproc", "4", "--config", str(ROOT / "tests/helpers/live_loop.yaml"),
                        "--run-dir", str(run_dir), "--set", "fault_tolerance.fsdp=true", "--",
                        sys.executable, str(ROOT / "tests/helpers/live_loop.py"), timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert errors == [errors[0]] and errors[0].startswith("trainguard: error: [rank 0] config key "
                                                          "'fault_tolerance.fsdp'"), errors
    beats = read_heartbeats(run_dir)
    assert sorted(beats) == [0, 1, 2, 3] and {beat.exit_code for beat in beats.values()} == {2}
