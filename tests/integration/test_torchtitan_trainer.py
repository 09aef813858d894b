"""torchtitan's own ``Trainer`` on Guard (``trainguard.integrations.torchtitan_trainer.GuardedTrainer``,
torchtitan 0.2.x), run as ``examples/torchtitan_trainer.py`` under torchrun on 1 GPU: SIGKILLed mid-run
and resumed, its final checkpoint is bitwise that of a run that never stopped, and holds the optimizer's,
the scheduler's, the data loader's and the trainer's own state (issue 38).

torchtitan's ``Trainer`` needs CUDA (``torch.cuda.set_device``); the refusals run anywhere torchtitan
0.2.x is installed. torchtitan is an optional test dependency: on the GPU machine, the wheels in .whl/
(``bash benchmarks/gpu_check.sh LOGS titan``); elsewhere ``pip install torchtitan==0.2.2 tyro torchdata``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.runs import assert_same_tensors, killed_then_resumed, torchrun, worker_env
from trainguard.errors import ConfigError

REASON = "torchtitan 0.2.x is not installed (optional: pip install torchtitan==0.2.2 tyro torchdata)"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_trainer.py"
STEPS = 8
TIMEOUT_S = 120

try:
    TITAN_VERSION = importlib.metadata.version("torchtitan")
except importlib.metadata.PackageNotFoundError:
    TITAN_VERSION = ""
if not TITAN_VERSION.startswith("0.2."):
    pytest.skip(REASON, allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def titan(monkeypatch):
    """``GuardedTrainer`` and torchtitan's ``ConfigManager``, imported with the example's placeholder for
    ``datasets`` (which torchtitan imports and no test here uses) where it is missing, for this test only:
    transformers, in the same process, asks whether ``datasets`` is installed."""
    if importlib.util.find_spec("datasets") is None:
        spec = importlib.util.spec_from_file_location("torchtitan_trainer_example", EXAMPLE)
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        for name, module in example.datasets_placeholder().items():
            monkeypatch.setitem(sys.modules, name, module)
    from torchtitan.config import ConfigManager

    from trainguard.integrations.torchtitan_trainer import GuardedTrainer

    return GuardedTrainer, ConfigManager


def run_example(run_dir: Path, faults: str | None = None) -> subprocess.CompletedProcess:
    env = worker_env(**({"TRAINGUARD_FAULTS": faults} if faults else {}))
    return torchrun(EXAMPLE, "--run-dir", str(run_dir), "--steps", str(STEPS), "--set", "checkpoint.save_interval=2",
                    nproc=1, env=env, timeout=TIMEOUT_S)


def logged_losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"step: \[\s*(\d+)/\s*\d+\], loss: ([\d.]+)", output)}


@needs_cuda
def test_killed_and_resumed_torchtitan_trainer_is_bitwise_identical(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    done = run_example(straight)
    assert done.returncode == 0, done.stdout[-4000:]
    resumed = killed_then_resumed(run_example, split, "kill:rank=0,step=5", logged_losses, STEPS)
    straight_losses = logged_losses(done.stdout)
    assert {s: straight_losses[s] for s in logged_losses(resumed.stdout)} == logged_losses(resumed.stdout)
    final = f"checkpoints/global_step_{STEPS}"
    assert assert_same_tensors(straight / final, split / final) > 20  # model and AdamW moments
    for run in (straight, split):
        extra = torch.load(run / final / "extra_state_world_size_1_rank_0.pt", weights_only=True)["stateful"]
        assert extra["scheduler"]["last_epoch"] == STEPS
        assert extra["train_state"]["step"] == STEPS
        assert set(extra["dataloader"]) == {"dp_rank_0", "world_size"}


@pytest.mark.parametrize("flag, named", [
    ("--checkpoint.enable", "checkpoint.enable"),
    ("--parallelism.pipeline_parallel_degree=2", "pipeline_parallel_degree"),
    ("--model.converters=float8", "model.converters"),
    ("--validation.enable", "validation.enable"),
    ("--metrics.enable_tensorboard", "metrics.enable_tensorboard"),
])
def test_what_cannot_run_on_guard_is_refused_in_one_line(titan, tmp_path, flag, named):
    GuardedTrainer, ConfigManager = titan
    job_config = ConfigManager().parse_args(["--job.dump_folder", str(tmp_path), flag])
    with pytest.raises(ConfigError, match=named) as refused:
        GuardedTrainer(job_config)
    assert "\n" not in str(refused.value)
