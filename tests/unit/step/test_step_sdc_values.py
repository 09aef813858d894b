"""SdcGuard.values(): every point's statistic, peak share and row odds read in one table, aligned by point."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trainguard.events.log import EventLog
from trainguard.guards.sdc import NOT_CHECKED, SdcConfig, row_odds
from trainguard.step.sdc import SdcGuard


class NoNorms(nn.Module):  # no norm layer and no block: only parameter-gradient points
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


def guard(model, **config) -> SdcGuard:
    sdc = SdcConfig(enabled_level=1, blocks=False, **config)
    sdc.validate()
    return SdcGuard(sdc, model, 1, torch.device("cpu"), 0, "h", logging.getLogger("test"), EventLog(None))


@pytest.mark.parametrize("peak, row_jump", [(0.5, 100.0), (0.0, 100.0), (0.5, 0.0), (0.0, 0.0)])
def test_values_without_module_points_align_with_the_parameter_gradients(peak, row_jump):
    model = NoNorms()
    sdc = guard(model, peak=peak, row_jump=row_jump)
    assert sdc.names == ["grad:proj.weight", "grad:proj.bias", "grad:head.weight", "grad:head.bias"]
    model(torch.randn(4, 8)).sum().backward()
    values, shares, rows = sdc.values()
    assert values == pytest.approx([torch.linalg.vector_norm(p.grad).item() for p in model.parameters()], rel=1e-6)
    assert (shares is None) == (peak == 0) and (rows is None) == (row_jump == 0)
    if rows is not None:  # the matrices get row odds (the head's single row does not), vectors none
        assert rows[0] == pytest.approx(row_odds(model.proj.weight.grad).item())
        assert rows[1:] == [NOT_CHECKED] * 3


def test_values_put_module_points_first_with_no_row_odds():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    sdc = guard(model, row_jump=100.0)
    assert sdc.names[0] == "1" and sdc.names[1:] == ["grad:0.weight", "grad:0.bias", "grad:1.weight", "grad:1.bias",
                                                     "grad:2.weight", "grad:2.bias"]
    model(torch.randn(4, 8)).sum().backward()
    values, shares, rows = sdc.values()
    assert len(values) == len(shares) == len(rows) == 7
    assert values[0] > 0 and rows[0] == NOT_CHECKED  # the norm's input gradient: a module point
    assert rows[1] == pytest.approx(row_odds(model[0].weight.grad).item()) and rows[2:] == [NOT_CHECKED] * 5


def test_the_layouts_are_compared_when_a_state_is_loaded_not_at_every_step(monkeypatch):
    """The comparison of every point's layout with its history's ran at every check; layouts change
    only where a state is loaded (a resume on another number of ranks)."""
    from trainguard.guards.sdc.detectors import SdcDetector

    model = NoNorms()
    sdc = guard(model)
    compared = []
    restart_changed = SdcDetector.restart_changed
    monkeypatch.setattr(SdcDetector, "restart_changed",
                        lambda self, names, layouts: compared.append(len(names)) or restart_changed(self, names, layouts))
    for step in (1, 2, 3):
        sdc.begin_pass()
        model(torch.randn(4, 8)).sum().backward()
        sdc.check(step)
    assert compared == [] and sorted(sdc.detector.points) == sorted(sdc.names)
    saved = sdc.stateful["sdc_detector"].state_dict()
    saved["layouts"] = {name: layout.replace("world 1", "world 4") for name, layout in saved["layouts"].items()}
    sdc.stateful["sdc_detector"].load_state_dict(saved)  # as saved on 4 ranks
    assert compared == [len(sdc.names)] and sdc.detector.points == {}  # every point starts a fresh warm-up
