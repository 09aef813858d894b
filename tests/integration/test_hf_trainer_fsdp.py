"""``GuardedTrainer`` with FSDP2 through accelerate: examples/hf_trainer.py ``--fsdp`` (``TrainingArguments(
fsdp=True, fsdp_config={"version": 2, ...})``) with trainguard's default config (async saves, every 50
steps), run as docs/library.md says, SIGKILLed after the save of step 50 under ``trainguard run``: it
resumes from that save and ends bitwise equal to a run that never stopped, logging the same steps.
That FSDP2 is on (not DDP) is checked in each start: rank 0 prints how many parameters are DTensors
once the Trainer prepared the model, and every one of them must be.

``cuda``: one GPU, one rank (torchrun --nproc-per-node 1), as a user runs it (skipped without CUDA).
``cpu-forced``: 2 gloo ranks with accelerate's accelerator-only FSDP check bypassed
(helpers/hf_fsdp_on_cpu.py), the rest accelerate's own FSDP2 path: what CPU-only machines can run of it.
Where accelerate does not turn FSDP on (CPU, as accelerate ships), ``--fsdp`` is refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from helpers.runs import launch_together
from helpers.hf_runs import (EXAMPLE, ROOT, assert_resumed_from_50_bitwise, example_command, logs, run,
                             run_killed_after_the_save_of_step_50, step_logs)

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

STEPS = 60  # past the default save interval (50): a kill at step 55 resumes from global_step_50
FORCED_ON_CPU = ROOT / "tests" / "helpers" / "hf_fsdp_on_cpu.py"
LOGGED = ("loss", "grad_norm", "learning_rate", "epoch")
SHARDED = re.compile(r"hf_trainer: FSDP2: (\d+) of (\d+) parameters are DTensors, (\d+) fully_shard units")
PLACES = {
    "cuda": pytest.param({"nproc": 1, "script": EXAMPLE}, id="cuda",
                         marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    "cpu-forced": pytest.param({"nproc": 2, "script": FORCED_ON_CPU}, id="cpu-forced"),
}


def assert_fsdp2_in_each_start(output: str, starts: int) -> None:
    reports = SHARDED.findall(output)
    assert len(reports) == starts, output[-4000:]
    for sharded, parameters, units in reports:
        assert int(sharded) == int(parameters) > 0 and int(units) > 1, output[-4000:]


@pytest.mark.parametrize("place", PLACES.values())
def test_fsdp2_fine_tune_sigkilled_under_the_supervisor_resumes_bitwise(place, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    # the straight run trains while the killed one stands still, dies and restarts under the supervisor
    runs = {"straight": lambda run_dir: run(example_command(run_dir, STEPS, "--fsdp", **place)),
            "killed": lambda run_dir: run_killed_after_the_save_of_step_50(run_dir, STEPS, "--fsdp", **place)}
    with launch_together(tmp_path, runs, concurrent=2) as launched:
        (_, straight_proc), (_, proc) = launched["straight"].result(), launched["killed"].result()
    assert straight_proc.returncode == 0, straight_proc.stdout[-4000:]
    assert_fsdp2_in_each_start(straight_proc.stdout, 1)

    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_fsdp2_in_each_start(proc.stdout, 2)
    resumed = assert_resumed_from_50_bitwise(straight, killed, STEPS)
    uninterrupted = step_logs(logs(straight))
    for step, entry in step_logs(resumed).items():  # the same device and kernels: the same values, bitwise
        assert [entry[key] for key in LOGGED] == [uninterrupted[step][key] for key in LOGGED], step


def test_fsdp_where_accelerate_does_not_turn_it_on_is_refused_in_one_line(tmp_path):
    """On CPU accelerate keeps FSDP off and the Trainer would silently run DDP: the adapter refuses."""
    run_dir = tmp_path / "refused"
    run_dir.mkdir()
    command = ["env", "CUDA_VISIBLE_DEVICES=", *example_command(run_dir, 4, "--fsdp", nproc=1)]
    proc = run(command)
    assert proc.returncode != 0
    refusals = [line for line in proc.stdout.splitlines() if "ValueError: GuardedTrainer: TrainingArguments(fsdp=" in line]
    assert refusals and refusals[0].endswith("but accelerate runs MULTI_CPU, not FSDP: it turns FSDP on only on "
                                             "accelerators (with use_cpu=True the Trainer would silently run DDP); "
                                             "give each rank a GPU, or leave fsdp unset"), proc.stdout[-4000:]
    assert not (run_dir / "checkpoints").exists()
