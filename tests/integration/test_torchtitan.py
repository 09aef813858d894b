"""torchtitan's own components on trainguard.Guard (tests/helpers/titan_loop.py: its Llama 3 model, its
OptimizersContainer and LRSchedulersContainer through ``trainguard.integrations.torchtitan``, FSDP2 over
2 gloo ranks): killed and resumed, the final checkpoint is bitwise that of a run that never stopped, and
every checkpoint holds the optimizer's state and the scheduler's (issue 38). torchtitan is an optional
test dependency: ``pip install torchtitan==0.3.0 triton torch==2.13.0``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (optional: pip install torchtitan==0.3.0 "
                                         "triton torch==2.13.0)")

import torch  # noqa: E402

from helpers.runs import assert_same_tensors, flat_state, killed_then_resumed, torchrun, worker_env  # noqa: E402

LOOP = Path(__file__).resolve().parents[1] / "helpers" / "titan_loop.py"
STEPS = 6
TIMEOUT_S = 300


def run_loop(run_dir: Path, faults: str | None = None):
    return torchrun(LOOP, "--run-dir", str(run_dir), "--steps", str(STEPS), "--set", "checkpoint.save_interval=2",
                    env=worker_env(**({"TRAINGUARD_FAULTS": faults} if faults else {})), timeout=TIMEOUT_S)


def outcome_steps(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"^outcome step=(\d+)", output, flags=re.M)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("titan") / "straight"
    proc = run_loop(run_dir)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return run_dir


def test_killed_and_resumed_torchtitan_components_are_bitwise_identical(straight, tmp_path):
    run_dir = tmp_path / "killed"
    killed_then_resumed(run_loop, run_dir, "kill:rank=1,step=5", outcome_steps, STEPS)
    final = "checkpoints/global_step_6"
    assert assert_same_tensors(straight / final, run_dir / final) > 0  # model and optimizer state
    for run in (straight, run_dir):
        extra = torch.load(run / final / "extra_state_world_size_2_rank_0.pt", weights_only=True)
        assert extra["stateful"]["scheduler"]["last_epoch"] == STEPS


def test_the_checkpoint_holds_the_optimizer_state(straight):
    """Before: the OptimizersContainer given to Guard kept its state in the optimizers it holds, and no
    checkpoint had any ('optim' missing)."""
    state = flat_state(straight / "checkpoints" / "global_step_4")
    moments = [k for k in state if k.startswith("optim.state.") and k.endswith((".exp_avg", ".exp_avg_sq"))]
    params = [k for k in state if k.startswith("model.")]
    assert len(moments) == 2 * len(params) > 0
    steps = {float(v) for k, v in state.items() if k.startswith("optim.state.") and k.endswith(".step")}
    assert steps == {4.0}
    assert any(bool(state[k].abs().sum() > 0) for k in moments)
