"""LazySnapshot: which copies are made at once, which are left for later, and that waiting makes them."""

from __future__ import annotations

import threading

import pytest
import torch

from trainguard.checkpoint.snapshot import CopySplit, LazySnapshot, mutable_by_optimizer


def _pairs(sources: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full_like(s, float("nan")), s) for s in sources]


def test_only_tensors_outside_the_optimizer_are_copied_at_once():
    model = torch.nn.Linear(64, 64)
    model.register_buffer("running", torch.arange(4.0))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    lazy = mutable_by_optimizer(model, optimizer)
    state = optimizer.state[model.weight]
    sources = [model.weight.data, model.bias.data, model.running, state["exp_avg"], state["exp_avg_sq"]]
    pairs = _pairs(sources)
    expected = [s.clone() for s in sources]
    snapshot = LazySnapshot(CopySplit.of(pairs, lazy), chunk_bytes=1024)
    assert torch.equal(pairs[2][0], expected[2])  # a module buffer: the forward pass may change it
    assert all(torch.isnan(buffer).all() for i, (buffer, _) in enumerate(pairs) if i != 2)
    model.running.add_(1)  # the next forward changes the buffer: the snapshot keeps the old value
    snapshot.wait()
    for (buffer, _), value in zip(pairs, expected):
        assert torch.equal(buffer, value)


def test_large_copies_are_chunked_and_shared_between_threads():
    source = torch.randn(10_000)
    strided = torch.randn(40, 30).t()  # not contiguous: copied whole
    pairs = _pairs([source, strided])
    snapshot = LazySnapshot(CopySplit.of(pairs, {source.data_ptr(), strided.data_ptr()}), chunk_bytes=4096)
    helpers = [threading.Thread(target=snapshot.copy) for _ in range(3)]
    for helper in helpers:
        helper.start()
    snapshot.copied()
    for helper in helpers:
        helper.join()
    assert torch.equal(pairs[0][0], source) and torch.equal(pairs[1][0], strided)


def test_a_failed_copy_is_raised_by_wait():
    source = torch.randn(8)
    snapshot = LazySnapshot(CopySplit.of([(torch.empty(4), source)], {source.data_ptr()}))
    with pytest.raises(RuntimeError):  # a copy between tensors of different sizes
        snapshot.wait()
    with pytest.raises(RuntimeError):
        snapshot.copied()
