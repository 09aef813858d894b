"""``ResumedLoader``: the Trainer's loader fast-forwarded to a resumed batch count, whole epochs by epoch
number and the rest by drawing, with the RNGs as they were (the uninterrupted run drew its iterator
before the checkpoint's RNG state was taken); ``SteppedByGuard`` turns the Trainer's own step into a no-op."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

from trainguard.integrations.hf_trainer import BatchPosition, ResumedLoader, SteppedByGuard  # noqa: E402


class EpochSeeded(RandomSampler):
    """A sampler whose order depends on the epoch only (as accelerate's seedable sampler)."""

    def __init__(self, data):
        super().__init__(data)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(len(self.data_source), generator=torch.Generator().manual_seed(self.epoch)).tolist())


class Loader(DataLoader):
    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def batches(loader, epochs: range) -> list[list[int]]:
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out += [b.tolist() for b in loader]
    return out


def make_loader() -> Loader:
    data = list(range(10))
    return Loader(data, batch_size=2, sampler=EpochSeeded(data))  # 5 batches per epoch


@pytest.mark.parametrize("resumed", [0, 3, 5, 7, 12])
def test_the_resumed_run_sees_the_batches_the_straight_run_would(resumed):
    straight = batches(make_loader(), range(4))
    loader = ResumedLoader(make_loader(), BatchPosition())
    if resumed:
        loader.resume_at(resumed)
    # the Trainer counts epochs from 0 again; it stops at max_steps, so only the prefix matters
    assert batches(loader, range(4))[: len(straight) - resumed] == straight[resumed:]


def test_fast_forward_leaves_the_rngs_as_they_were():
    loader = ResumedLoader(make_loader(), BatchPosition())
    loader.resume_at(3)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    iterator = iter(loader)
    next(iterator)  # creating the iterator and dropping 3 batches happen here
    assert torch.equal(torch.rand(3), expected)


def test_the_trainers_step_is_a_no_op_after_the_guard_took_over():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    parameter.grad = torch.ones(2)
    taken = SteppedByGuard(optimizer)
    taken.step()
    assert torch.equal(parameter.detach(), torch.ones(2))
    assert taken.param_groups is optimizer.param_groups  # everything else is the real one's
