"""examples/fsdp2_loop.py under torchrun (2 ranks, gloo): stopped at step 3 and run again, it ends
bitwise identical to a run that went to step 6 without stopping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.fs.layout import LATEST_FILE, extra_state_name, step_dir_name
from trainguard.checkpoint.safe_load import safe_torch_load
from helpers.runs import torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_loop.py"
STEPS = 6
NPROC = 2
TIMEOUT_S = 180  # per launch; one takes about 10 s on two idle cores


def run_example(run_dir: Path, *extra: str) -> str:
    """Runs the example under torchrun; returns its output, failing the test on a non-zero exit."""
    proc = torchrun(EXAMPLE, "--run-dir", str(run_dir), "--steps", str(STEPS), "--save-interval", "2", *extra,
                    nproc=NPROC, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"the example exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same(a: Any, b: Any, where: str) -> None:
    """Equal structure; tensors bitwise equal (dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys differ: {set(a) ^ set(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_stopped_and_resumed_run_is_bitwise_identical(tmp_path: Path):
    straight, interrupted = tmp_path / "a", tmp_path / "b"

    out_a = run_example(straight)
    out_b1 = run_example(interrupted, "--stop-after", "3")
    out_b2 = run_example(interrupted)

    assert "resumed from step" not in out_a and "resumed from step" not in out_b1
    assert "step 3/6" in out_b1 and "step 4/6" not in out_b1
    assert "resumed from step 3" in out_b2, out_b2[-3000:]
    assert "step 3/6" not in out_b2 and "step 4/6" in out_b2 and "step 6/6" in out_b2

    final_a = straight / "checkpoints" / step_dir_name(STEPS)
    final_b = interrupted / "checkpoints" / step_dir_name(STEPS)
    for run_dir in (straight, interrupted):
        assert (run_dir / "checkpoints" / LATEST_FILE).read_text().strip() == str(STEPS)

    state_a, state_b = read_full_state_dict(final_a), read_full_state_dict(final_b)
    assert any(key.startswith("model.") for key in state_a) and any(key.startswith("optim.") for key in state_a)
    assert_same(state_a, state_b, "state")
    # Every rank's extra state too: RNGs, LR scheduler, data position.
    for rank in range(NPROC):
        name = extra_state_name(NPROC, rank)
        assert_same(safe_torch_load(final_a / name), safe_torch_load(final_b / name), f"rank {rank} extra state")

    # Not vacuous: the weights did move between the checkpoint resumed from and the final one.
    resumed_from = read_full_state_dict(interrupted / "checkpoints" / step_dir_name(3))
    weight = "model.embed.weight"
    assert not torch.equal(resumed_from[weight], state_b[weight])
