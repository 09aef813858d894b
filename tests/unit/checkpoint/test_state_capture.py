"""CaptureCache: the staging plan kept between saves, its plain values read again, retaken when a
tensor is replaced."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint.state_dict import training_state
from trainguard.checkpoint.state_capture import CaptureCache, plain_values

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(optimizer_class=torch.optim.AdamW):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_kept_plan_reads_plain_values_again_and_copies_the_same_tensors():
    model, optimizer = _trained()
    cache = CaptureCache(training_state)
    first = cache.take(model, optimizer)
    optimizer.param_groups[0]["lr"] = 0.025  # a scheduler's step
    second = cache.take(model, optimizer)
    assert cache.hits == 1
    fresh = training_state(model, optimizer)
    assert second.plan.staged["optim"].keys() == fresh["optim"].keys()
    for key, value in fresh["optim"].items():
        if not isinstance(value, torch.Tensor):
            assert second.plan.staged["optim"][key] == value and type(second.plan.staged["optim"][key]) is type(value)
    assert first.plan.staged["optim"]["param_groups.0.weight.lr"] == 0.1  # the earlier save keeps its value
    assert [id(b) for b, _ in second.plan.copies] == [id(b) for b, _ in first.plan.copies]
    assert {s.data_ptr() for _, s in second.plan.copies} >= {p.data_ptr() for p in model.parameters()}


def test_an_optimizer_that_holds_no_state_keeps_its_plan_for_the_model_alone():
    # plain SGD (no momentum) never has optimizer state, so a save holds the model only; its second save
    # reused the plan and raised KeyError: 'optim' (found by a live durable tier's second save)
    model, optimizer = _trained(torch.optim.SGD)
    cache = CaptureCache(training_state)
    first = cache.take(model, optimizer)
    second = cache.take(model, optimizer)
    assert cache.hits == 1
    assert set(second.plan.staged) == set(first.plan.staged) == {"model"}
    assert {s.data_ptr() for _, s in second.plan.copies} >= {p.data_ptr() for p in model.parameters()}


def test_a_replaced_tensor_or_new_state_takes_the_state_again():
    model, optimizer = _trained()
    cache = CaptureCache(training_state)
    cache.take(model, optimizer)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # not the same tensor any more
    optimizer.param_groups[0]["params"][0] = model[0].weight
    optimizer.state[model[0].weight] = optimizer.state.pop(next(iter(optimizer.state)))
    taken = cache.take(model, optimizer)
    assert cache.hits == 0
    assert any(source is not None and source.data_ptr() == model[0].weight.data_ptr() for _, source in taken.plan.copies)


def test_no_cache_when_a_plain_value_has_no_live_source():
    model, optimizer = _trained()
    state = training_state(model, optimizer)
    assert plain_values(state, model, optimizer) is not None
    state["optim"]["param_groups.0.weight.unknown"] = 3
    assert plain_values(state, model, optimizer) is None
    state = training_state(model, optimizer)
    optimizer.param_groups[0]["foreach"] = [1]  # a mutable value: the staged copy could change under it
    state["optim"] = dict(state["optim"], **{"param_groups.0.weight.foreach": [1]})
    assert plain_values(state, model, optimizer) is None


def test_settings_of_several_groups_and_plain_state_values_are_read_from_the_live_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adafactor([{"params": model[0].parameters()},
                                       {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.state[model[1].bias]["plain"] = 7  # a per-parameter value kept as a number
    cache = CaptureCache(training_state)
    cache.take(model, optimizer)
    optimizer.param_groups[1]["lr"] = 0.25
    optimizer.param_groups[0] = dict(optimizer.param_groups[0], lr=0.05)  # load_state_dict makes new group dicts
    optimizer.state[model[1].bias]["plain"] = 8
    second = cache.take(model, optimizer)
    assert cache.hits == 1
    staged = second.plan.staged["optim"]
    assert staged["param_groups.0.weight.lr"] == staged["param_groups.0.bias.lr"] == 0.05
    assert staged["param_groups.1.weight.lr"] == staged["param_groups.1.bias.lr"] == 0.25
    assert staged["state.1.bias.plain"] == 8
    fresh = training_state(model, optimizer)["optim"]
    assert {k: v for k, v in staged.items() if not isinstance(v, torch.Tensor)} == \
        {k: v for k, v in fresh.items() if not isinstance(v, torch.Tensor)}
