"""torchtitan's own ``Trainer`` on Guard (``trainguard.integrations.torchtitan_trainer.GuardedTrainer``,
torchtitan 0.2.x), run as ``examples/torchtitan_trainer.py`` under torchrun on 1 GPU: SIGKILLed mid-run
and resumed, its final checkpoint is bitwise that of a run that never stopped, and holds the optimizer's,
the scheduler's, the data loader's and the trainer's own state (issue 38).

torchtitan's ``Trainer`` needs CUDA (``torch.cuda.set_device``); the refusals run anywhere torchtitan
0.2.x is installed. torchtitan is an optional test dependency: on the GPU machine, the wheels in .whl/
(``bash benchmarks/gpu_check.sh LOGS titan``); elsewhere ``pip install torchtitan==0.2.2 tyro torchdata``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REASON = "torchtitan 0.2.x is not installed (optional: pip install torchtitan==0.2.2 tyro torchdata)"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_trainer.py"
STEPS = 8
TIMEOUT_S = 120

try:  # the example's placeholder for `datasets`, which torchtitan imports and this run never uses
    sys.path.insert(0, str(EXAMPLE.parent))
    from torchtitan_trainer import register_datasets_placeholder
finally:
    sys.path.pop(0)
register_datasets_placeholder()
if not getattr(pytest.importorskip("torchtitan", reason=REASON), "__version__", "").startswith("0.2."):
    pytest.skip(REASON, allow_module_level=True)

import torch  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from helpers.runs import assert_same_tensors, killed_then_resumed, torchrun, worker_env  # noqa: E402
from trainguard.errors import ConfigError  # noqa: E402
from trainguard.integrations.torchtitan_trainer import GuardedTrainer  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
])
def test_what_cannot_run_on_guard_is_refused_in_one_line(tmp_path, flag, named):
    job_config = ConfigManager().parse_args(["--job.dump_folder", str(tmp_path), flag])
    with pytest.raises(ConfigError, match=named) as refused:
        GuardedTrainer(job_config)
    assert "\n" not in str(refused.value)
