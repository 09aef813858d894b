"""A micro-batch's random draws (dropout) are a function of (run seed, step, micro-batch): whichever
process computes it, whatever it drew before, the same gradient; another micro-batch, another mask."""

from __future__ import annotations

import torch

from trainguard.live.rng import micro_batch_seed
from trainguard.live.micro_batch import micro_batch_grad

FEATURES = 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(64, 1))


def _loss_of(model, step, micro_batch):
    inputs = torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(step * 100 + micro_batch))
    return model(inputs).pow(2).mean()


def _first_layer_mask(grad: torch.Tensor) -> torch.Tensor:
    """Which hidden units dropout kept: their first-layer bias gradient is non-zero only if kept."""
    bias = grad[FEATURES * 64:FEATURES * 64 + 64]
    return bias != 0


def test_the_same_micro_batch_gives_the_same_gradient_whatever_was_drawn_before():
    model = _model()
    _, first = micro_batch_grad(model, _loss_of, 7, 3, 8, seed=42)
    torch.rand(1000)  # another history of the process's own generator (another rank, a replacement)
    torch.manual_seed(12345)
    _, again = micro_batch_grad(model, _loss_of, 7, 3, 8, seed=42)
    assert torch.equal(first.view(torch.uint8), again.view(torch.uint8))
    # and dropout did draw: the same loss in eval mode (no dropout) has another gradient
    model.eval()
    assert not torch.equal(micro_batch_grad(model, _loss_of, 7, 3, 8, seed=42)[1], first)


def test_other_micro_batches_steps_and_seeds_draw_other_masks():
    model = _model()

    def same_inputs(model, step, micro_batch):  # so that only the draws can differ between the keys
        return _loss_of(model, 7, 3)

    def mask(step, micro_batch, seed):
        return _first_layer_mask(micro_batch_grad(model, same_inputs, step, micro_batch, 8, seed=seed)[1])

    reference = mask(7, 3, 42)
    assert 0 < int(reference.sum()) < 64  # dropout kept some units and dropped others
    for step, micro_batch, seed in [(7, 4, 42), (8, 3, 42), (7, 3, 43)]:
        assert not torch.equal(mask(step, micro_batch, seed), reference), (step, micro_batch, seed)


def test_the_process_generator_is_left_as_it_was():
    model = _model()
    before = torch.get_rng_state()
    micro_batch_grad(model, _loss_of, 0, 0, 8, seed=1)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_seed_is_a_function_of_the_three_numbers_only():
    assert micro_batch_seed(42, 7, 3) == 4023695223784337871  # pinned: every process, every Python, the same
    assert len({micro_batch_seed(42, t, m) for t in range(50) for m in range(50)}) == 2500
    assert 0 <= micro_batch_seed(2**40, 10**9, 7) < 2**63
