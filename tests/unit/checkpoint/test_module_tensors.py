"""ModuleTensors: a model's parameters and buffers walked again only once something was registered."""

from __future__ import annotations

import torch

from trainguard.checkpoint.module_tensors import ModuleTensors


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))


def _walk(model: torch.nn.Module) -> list[int]:
    return [id(t) for t in list(model.parameters()) + list(model.buffers())]


def test_the_walk_is_kept_until_a_module_registers_something():
    model = _model()
    tensors = ModuleTensors()
    first = tensors.of(model)
    assert [id(t) for t in first] == _walk(model)
    assert tensors.of(model) is first and tensors.walks == 1
    with torch.no_grad():
        model[0].weight.add_(1)  # values change in place: no registration
    model(torch.randn(3, 4))  # a forward updates the running statistics in place
    assert tensors.of(model) is first and tensors.walks == 1

    changes = [
        lambda: setattr(model[0], "weight", torch.nn.Parameter(torch.zeros(4, 4))),  # a parameter replaced
        lambda: setattr(model[1], "running_mean", torch.zeros(4)),  # a buffer replaced by assignment
        lambda: model[0].register_buffer("scale", torch.ones(1)),  # a buffer added
        lambda: model.append(torch.nn.Linear(4, 2)),  # a module added
        lambda: model[2].register_parameter("extra", torch.nn.Parameter(torch.ones(2))),
    ]
    for change in changes:
        walks = tensors.walks
        change()
        assert [id(t) for t in tensors.of(model)] == _walk(model)
        assert tensors.walks == walks + 1


def test_another_model_is_walked():
    tensors = ModuleTensors()
    a, b = _model(), _model()
    tensors.of(a)
    assert [id(t) for t in tensors.of(b)] == _walk(b)
    assert [id(t) for t in tensors.of(a)] == _walk(a) and tensors.walks == 3


def test_modules_a_forward_builds_for_itself_do_not_count():
    class Sliced(torch.nn.Module):  # as Hugging Face's Llama: ``for layer in self.layers[:n]``
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:  # a new ModuleList, the layers registered in it
                x = layer(x)
            return x

    model = Sliced()
    tensors = ModuleTensors()
    tensors.of(model)
    model(torch.randn(2, 4))
    torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # modules of no model built meanwhile
    tensors.of(model)
    assert tensors.walks == 1
    detached = torch.nn.Linear(4, 4)
    detached.register_buffer("extra", torch.ones(1))  # on a module outside the model: not counted ...
    tensors.of(model)
    assert tensors.walks == 1
    model.layers.append(detached)  # ... until it is attached
    assert [id(t) for t in tensors.of(model)] == _walk(model) and tensors.walks == 2
