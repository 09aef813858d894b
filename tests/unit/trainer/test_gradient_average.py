"""FSDP2 over gloo averages gradients across data-parallel ranks, on every supported torch (under torch
2.8, gloo's AVG sums: ``ensure_gradient_average`` detects it and switches FSDP2 to sum-then-divide)."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from helpers.forked_ranks import run_forked_ranks

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _inputs(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4).add(rank * 5.0).div(10)


def _reference_gradients() -> dict[str, torch.Tensor]:
    """The gradient of the mean of the ranks' losses, in one process."""
    model = _model()
    sum(model(_inputs(rank)).square().sum() for rank in range(WORLD)).div(WORLD).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def _rank(rank: int, store: str, force: bool, results: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from trainguard.trainer.gradient_average import backend_averages, ensure_gradient_average

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        switched = ensure_gradient_average(model, mesh, force=force)
        assert switched == (force or not backend_averages(mesh.get_group())), switched
        model(_inputs(rank)).square().sum().backward()
        expected = _reference_gradients()
        for name, param in model.named_parameters():
            got = param.grad.full_tensor()
            assert torch.allclose(got, expected[name], rtol=1e-5, atol=1e-6), (name, got, expected[name])
        dist.destroy_process_group()
        Path(results, f"ok{rank}").write_text(f"switched={switched}")
    except BaseException:
        Path(results, f"error{rank}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize("force", [False, True], ids=["as-detected", "forced-sum-then-divide"])
def test_fsdp2_gradients_are_the_mean_over_ranks(tmp_path, force):
    results = tmp_path / "results"
    results.mkdir()
    run_forked_ranks(_rank, WORLD, (str(tmp_path / "store"), force, str(results)), results)
