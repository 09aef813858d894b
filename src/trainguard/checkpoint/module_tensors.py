"""A model's parameters and buffers, walked again only after something was registered on a module.

Walking a module tree (``model.parameters()``, ``model.buffers()``) costs a few hundred microseconds
of Python per save even on a small model, the largest part of what a lazy save blocks the loop for
(measured: ``benchmarks/RESULTS.md``, session 11). A tree changes through registrations:
``register_parameter``, ``register_buffer``, ``register_module`` and the attribute assignments that
call them, each reported to torch's global registration hooks. ``ModuleTensors`` keeps its last walk
of a model beside a count of the registrations on the modules it walked (``RegistrationCount``) and
walks again once the count has moved or another model is asked for.

The hooks do not see ``del module.name`` nor writes into a module's private dicts. FSDP2 swaps its
sharded and unsharded parameters that way around forward and backward and puts the same sharded
parameter objects back before the optimizer step, which is what a kept walk holds. Callers also
compare every tensor's storage address with the one they planned with, so a storage swapped in
place (``param.data = ...``) is seen as well.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class RegistrationCount:
    """How many parameters, buffers and submodules were registered on the watched modules since the
    first ``now()`` (which installs the hooks). Only watched modules count: a model's forward may
    build modules of its own at every step (slicing a ``ModuleList`` makes a new one and registers
    the layers in it, as Hugging Face's Llama does), which change no tree that is saved."""

    def __init__(self) -> None:
        self.count = 0
        self._watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._installed = False

    def watch(self, modules: list[torch.nn.Module]) -> None:
        self._watched.update(modules)

    def now(self) -> int:
        if not self._installed:
            self._installed = True
            for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                             register_module_module_registration_hook):
                register(self._registered)
        return self.count

    def _registered(self, module: torch.nn.Module, name: str, value: object) -> None:
        if module in self._watched:  # returns None: the registration goes on unchanged
            self.count += 1


REGISTRATIONS = RegistrationCount()


class ModuleTensors:
    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._count = -1
        self._tensors: list[torch.Tensor] = []
        self.walks = 0

    def of(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """``list(model.parameters()) + list(model.buffers())``, from the last walk while nothing was
        registered since (the caller must not change the list)."""
        count = REGISTRATIONS.now()  # read before the walk: a registration during it moves the count
        if model is not self._model or count != self._count:
            REGISTRATIONS.watch(list(model.modules()))  # a module attached later registers on one of these
            self._tensors = list(model.parameters()) + list(model.buffers())
            self._model, self._count = model, count
            self.walks += 1
        return self._tensors
