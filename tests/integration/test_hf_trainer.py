"""``GuardedTrainer`` (trainguard.integrations.hf_trainer) in examples/hf_trainer.py: a Hugging Face ``Trainer``
fine-tune of a tiny Qwen2 with DDP through accelerate, 2 gloo ranks under torchrun. Killed and run again it
resumes from trainguard's checkpoint and ends bitwise equal to a run that never stopped; a gradient spike is
skipped by the guard, not applied by the Trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import assert_same_tensors, events, finish_session, worker_env

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
STEPS = 6
SPIKE = "spike:step=3"
GUARDS = ["checkpoint.save_interval=1", "checkpoint.async_save=false", "guards.skip.enabled=true",
          "guards.skip.threshold=50"]
TIMEOUT_S = 600


def fine_tune(run_dir: Path, faults: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
               "--run-dir", str(run_dir), "--steps", str(STEPS)]
    for override in GUARDS:
        command += ["--set", override]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(TRAINGUARD_FAULTS=faults), start_new_session=True)
    return finish_session(proc, TIMEOUT_S, "the fine-tune")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf_trainer") / "straight"
    proc = fine_tune(run_dir, SPIKE)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return run_dir


def test_spike_is_skipped_by_the_guard(straight):
    (skip,) = events(straight, "data_skip")
    assert skip["step"] == 3 and skip["global_norm"] > 50
    steps = {e["step"]: e for e in events(straight, "step")}
    assert sorted(steps) == list(range(1, STEPS + 1)) and steps[3]["skipped"] and not steps[4]["skipped"]
    assert (straight / "checkpoints" / f"global_step_{STEPS}" / "huggingface" / "config.json").is_file()


def test_killed_and_resumed_fine_tune_is_bitwise_identical(straight, tmp_path):
    run_dir = tmp_path / "killed"
    killed = fine_tune(run_dir, f"{SPIKE};kill:rank=1,step=5")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert max(e["step"] for e in events(run_dir, "step")) == 4
    resumed = fine_tune(run_dir, f"{SPIKE};kill:rank=1,step=5")  # fired faults do not fire again
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    (started,) = [e for e in events(run_dir, "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_4")
    assert [e["step"] for e in events(run_dir, "data_skip")] == [3]
    final = f"global_step_{STEPS}"
    assert assert_same_tensors(straight / "checkpoints" / final, run_dir / "checkpoints" / final) > 0
