"""The global norm's weighting rule and NaN/Inf behaviour, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from trainguard.norms import clip_grads_, global_norm_and_sums, local_sq_sum


def test_plain_tensors_give_the_l2_norm():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    norm, sums = global_norm_and_sums(grads, torch.tensor([2.5]), ranks_per_stage=1)
    assert norm == 13.0 and sums == [2.5]


def test_replicas_are_weighted_by_their_copy_count():
    # a plain tensor on every rank of a 4-rank stage counts a quarter per rank
    share = local_sq_sum([torch.tensor([2.0])], ranks_per_stage=4, device=torch.device("cpu"))
    assert share.item() == 1.0


def test_nan_and_inf_propagate():
    norm, _ = global_norm_and_sums([torch.tensor([1.0, float("nan")])], torch.zeros(0), ranks_per_stage=1)
    assert math.isnan(norm)
    norm, _ = global_norm_and_sums([torch.tensor([float("inf")])], torch.zeros(0), ranks_per_stage=1)
    assert norm == math.inf


def test_clip_scales_to_max_norm_and_leaves_small_grads():
    grads = [torch.tensor([3.0, 4.0])]
    assert clip_grads_(grads, max_norm=1.0, total_norm=5.0) < 1
    assert torch.allclose(grads[0].norm(), torch.tensor(1.0), atol=1e-5)
    grads = [torch.tensor([0.3, 0.4])]
    assert clip_grads_(grads, max_norm=1.0, total_norm=0.5) == 1.0
    assert torch.equal(grads[0], torch.tensor([0.3, 0.4]))
    assert clip_grads_(grads, max_norm=1.0, total_norm=float("nan")) == 1.0


def test_known_norms_are_reused_bitwise_and_a_stale_pair_is_not():
    from trainguard.guards.sdc import GradientPoints

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model(torch.randn(4, 8)).sum().backward()
    points = GradientPoints(model, "l2", shares=True)
    points.collect(with_shares=True)
    grads = [p.grad for p in model.parameters()]
    measured = local_sq_sum(grads, 1, torch.device("cpu"))
    assert torch.equal(local_sq_sum(grads, 1, torch.device("cpu"), known=points.norms), measured)
    # with the row odds a matrix's norm comes from its rows' energies: the same up to the last bits,
    # and the global norm takes it as it is
    with_rows = GradientPoints(model, "l2", shares=True, rows=True)
    with_rows.collect(with_shares=True, with_rows=True)
    reused = local_sq_sum(grads, 1, torch.device("cpu"), known=with_rows.norms)
    assert torch.equal(reused, torch.stack([n.double().square() for _, n in with_rows.norms]).sum())
    assert reused.item() == pytest.approx(measured.item(), rel=1e-6)
    # a pair whose gradient is another tensor (a new backward since) is ignored, never trusted
    stale = [(g.clone(), torch.tensor(1e9)) for g in grads]
    assert torch.equal(local_sq_sum(grads, 1, torch.device("cpu"), known=stale), measured)
    # the pairs really are used: a planted value changes the sum
    planted = [(grads[0], torch.tensor(0.0))] + points.norms[1:]
    assert local_sq_sum(grads, 1, torch.device("cpu"), known=planted) < measured
    points.forget()
    assert points.norms == []
