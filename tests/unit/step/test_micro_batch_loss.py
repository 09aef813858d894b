"""``guard.step(loss_of)`` in the closure mode (``step/micro_batches.py``): the loop of both modes hands the
loss of one micro-batch by index; the guard runs this rank's share of the global batch
(``train.micro_batches``) with each micro-batch's random draws seeded from ``(train.seed, step,
micro_batch)`` as live mode does, scaled so that the step's gradient and loss are those of the batch's
mean. One process here (no data parallelism); the multi-rank runs are test_user_loop_faults.py (FSDP2
under torchrun) and test_live_user_loop.py (the same loop in live mode)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

import trainguard
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.events.log import read_events
from trainguard.live.rng import micro_batch_rng
from trainguard.step.micro_batches import DataParallelPlace, micro_batch_closure, takes_no_arguments

MICRO_BATCHES, SEED, STEPS = 4, 11, 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + micro_batch)
    inputs, labels = torch.randn(2, 3, generator=generator), torch.randn(2, 1, generator=generator)
    return torch.nn.functional.mse_loss(model(inputs), labels)


def sample_range(step: int, micro_batch: int) -> tuple[int, int]:
    first = (step * MICRO_BATCHES + micro_batch) * 2
    return first, first + 2


def test_a_closure_is_told_from_a_micro_batch_loss_by_its_arguments():
    assert takes_no_arguments(lambda: None) and takes_no_arguments(lambda scale=1.0: None)
    assert not takes_no_arguments(loss_of) and not takes_no_arguments(lambda model, step, micro_batch: None)


def test_the_guard_trains_the_mean_of_the_global_batch_with_live_modes_seeding_bitwise(tmp_path, quiet):
    config = load_config(None, [f"train.micro_batches={MICRO_BATCHES}", f"train.seed={SEED}", "optim.grad_clip=0",
                                "checkpoint.save_interval=0"])
    model, optimizer = build()
    expected_model, expected_optimizer = copy.deepcopy((model, optimizer))
    guard = trainguard.Guard(tmp_path, model, optimizer, config=config)
    step, losses = guard.resume(), []
    while not guard.should_stop(step, STEPS):
        outcome = guard.step(loss_of, sample_range)
        step, losses = outcome.step, losses + [outcome.loss]
    assert guard.close() == 0 and step == STEPS
    ranges = [e["sample_ranges"] for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "step"]
    assert ranges == [[list(sample_range(step, m)) for m in range(MICRO_BATCHES)] for step in range(STEPS)]

    for step in range(STEPS):  # the contract, by hand: data position = step, draws from (seed, step, micro-batch)
        expected_optimizer.zero_grad(set_to_none=True)
        mean = 0.0
        for micro_batch in range(MICRO_BATCHES):
            with micro_batch_rng(SEED, step, micro_batch):
                loss = loss_of(expected_model, step, micro_batch) / MICRO_BATCHES
                loss.backward()
            mean += loss.item()
        assert losses[step] == pytest.approx(mean, rel=1e-6)
        expected_optimizer.step()
    for (name, trained), expected in zip(model.state_dict().items(), expected_model.state_dict().values()):
        assert torch.equal(trained, expected), name


@dataclass(frozen=True)
class Mesh:
    """What ``DataParallelPlace.of`` reads of a ``DeviceMesh``: its dims' names and sizes, this rank's coordinate."""
    mesh_dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    coordinate: tuple[int, ...]

    def get_coordinate(self) -> list[int]:
        return list(self.coordinate)


def test_the_data_parallel_place_counts_the_replicate_and_shard_dims_only():
    assert DataParallelPlace.of(None, 3, 4) == DataParallelPlace(3, 4)
    hsdp_tp = Mesh(("dp_replicate", "dp_shard", "tp"), (2, 3, 2), (1, 2, 1))
    assert DataParallelPlace.of(hsdp_tp, 11, 12) == DataParallelPlace(1 * 3 + 2, 6)


def test_a_global_batch_that_does_not_split_evenly_is_one_error_naming_the_key():
    model, _ = build()
    with pytest.raises(ConfigError, match=r"config key 'train.micro_batches' is 4, not a multiple of the 3 "
                                          r"data-parallel ranks"):
        micro_batch_closure(loss_of, model, 0, 4, DataParallelPlace(0, 3), SEED)


def test_each_rank_runs_its_share_scaled_so_the_average_over_ranks_is_the_batch_mean():
    calls: list[tuple[int, int]] = []

    def recorded(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        calls.append((step, micro_batch))
        return loss_of(model, step, micro_batch)

    model, _ = build()
    total = micro_batch_closure(recorded, model, 5, 6, DataParallelPlace(1, 3), SEED)()
    assert calls == [(5, 1), (5, 4)]
    with micro_batch_rng(SEED, 5, 1):
        first = loss_of(model, 5, 1)
    with micro_batch_rng(SEED, 5, 4):
        second = loss_of(model, 5, 4)
    assert torch.allclose(total, (first + second) * 3 / 6)
