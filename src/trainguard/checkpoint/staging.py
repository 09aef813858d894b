"""Staging for async saves: a copy of the state dict in CPU buffers that are allocated once and reused.

An async save may only return once the bytes it will write are independent of the live tensors (the
next optimizer step mutates them in place). DCP's default staging allocates a fresh CPU state dict on
every save (deep-copying each CPU ``DTensor`` and then copying again), and its cached variant pins
memory, which fails on CPU-only builds. ``ReusableStager`` copies each tensor exactly once into a
buffer kept from the previous save while the layout (shapes, dtypes, devices, in traversal order) is
unchanged, and reallocates when it changes. Buffers are pinned only when the source is on a CUDA
device.

``stage`` copies before it returns; ``plan`` returns the copies to make, so that they can be made
later, while the next forward and backward run (``trainguard.checkpoint.snapshot``).

Only one save may use the buffers at a time: the caller must not stage again before the write of the
previous staged copy has finished (``DurableCheckpointer`` waits for the previous commit first).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)

Layout = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class StagingPlan:
    staged: Any
    """The state dict's structure around the staging buffers (valid once ``copies`` are made)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    """``(buffer, live source)`` pairs, in traversal order."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _sharded_tensor_type() -> type | None:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return None
    return ShardedTensor


class ReusableStager:
    """Copies state dicts into CPU buffers reused across calls while the layout is the same.

    ``stage(state_dict)`` returns a structure like ``state_dict`` (dicts, lists and tuples rebuilt)
    whose tensors are CPU copies (``DTensor`` s rebuilt around a copy of their local shard, with the
    same spec) and whose other leaves are deep copies. The returned copy stays valid until the next
    ``stage`` call, which overwrites it.
    """

    def __init__(self, allocate: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> None:
        """``allocate(sources)`` gives a CPU buffer shaped like each source (default: one tensor each;
        a writer process's shared memory, ``WriterProcess.allocate``)."""
        self._allocate = allocate or allocate_each
        self._layout: Layout | None = None
        self._buffers: list[torch.Tensor] = []
        self.allocations = 0
        """How many times the buffer set was (re)allocated; the first ``stage`` allocates."""
        self._dtensor = _dtensor_type()
        self._sharded_tensor = _sharded_tensor_type()

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(buffer.nbytes for buffer in self._buffers)

    def close(self) -> None:
        """Releases the buffers (the next ``stage`` allocates again)."""
        self._layout = None
        self._buffers = []

    def stage(self, state_dict: Any) -> Any:
        plan = self.plan(state_dict)
        asynchronous = False
        for buffer, source in plan.copies:
            non_blocking = buffer.is_pinned() and source.device.type == "cuda"
            buffer.copy_(source.detach(), non_blocking=non_blocking)
            asynchronous = asynchronous or non_blocking
        if asynchronous:
            torch.cuda.synchronize()
        return plan.staged

    def plan(self, state_dict: Any) -> StagingPlan:
        """The staged structure around the (reused) buffers and the copies that fill them, not yet
        made: the staged copy is valid once every ``(buffer, source)`` pair has been copied (a lazy
        snapshot, ``trainguard.checkpoint.snapshot``, makes them in the background)."""
        sources: list[torch.Tensor] = []
        skeleton = self._collect(state_dict, sources)
        layout: Layout = tuple(
            (tuple(t.shape), t.dtype, t.device.type, t.layout, _wants_pinned(t)) for t in sources
        )
        if layout != self._layout:
            self._buffers = []  # drop the old set before allocating the new one
            self._buffers = self._allocate(sources)
            self._layout = layout
            self.allocations += 1
        return StagingPlan(skeleton(iter(self._buffers)), list(zip(self._buffers, sources)))

    # The traversal returns a builder that, given the staged buffers in traversal order, rebuilds the
    # structure; collecting sources first lets the layout be compared before anything is allocated.
    def _collect(self, obj: Any, sources: list[torch.Tensor]) -> Callable[[Any], Any]:
        dtensor, sharded = self._dtensor, self._sharded_tensor
        if dtensor is not None and isinstance(obj, dtensor):
            sources.append(obj._local_tensor)
            spec = obj._spec
            return lambda buffers: dtensor(next(buffers), spec, requires_grad=False)
        if sharded is not None and isinstance(obj, sharded):
            # Not produced by FSDP2/TP state dicts: staged with DCP's own helpers, without reuse.
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

            def stage_sharded(buffers: Any) -> Any:
                staged = _create_cpu_state_dict({"t": obj})
                return _copy_state_dict({"t": obj}, staged)["t"]

            return stage_sharded
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_meta:
                return lambda buffers: obj.detach().clone()
            sources.append(obj)
            return lambda buffers: next(buffers)
        if isinstance(obj, dict):
            builders = [(key, self._collect(value, sources)) for key, value in obj.items()]
            kind = type(obj)

            def build_dict(buffers: Any) -> Any:
                items = [(key, build(buffers)) for key, build in builders]
                try:
                    return kind(items)
                except TypeError:
                    return dict(items)

            return build_dict
        if isinstance(obj, (list, tuple)):
            builders_seq = [self._collect(value, sources) for value in obj]
            kind_seq = type(obj)

            def build_seq(buffers: Any) -> Any:
                items = [build(buffers) for build in builders_seq]
                if kind_seq in (list, tuple):
                    return kind_seq(items)
                try:
                    return kind_seq(*items) if hasattr(kind_seq, "_fields") else kind_seq(items)
                except TypeError:
                    return list(items) if isinstance(obj, list) else tuple(items)

            return build_seq
        if isinstance(obj, _IMMUTABLE):
            return lambda buffers: obj
        snapshot = copy.deepcopy(obj)  # now: the caller may mutate it as soon as stage() returns
        return lambda buffers: snapshot


def is_immutable(value: Any) -> bool:
    """Whether a plain value can be kept as it is in a staged copy (nothing can change it in place)."""
    if type(value) is tuple:  # plain values first: a Python RNG state is a tuple of 625 ints
        kinds = set(map(type, value))  # judged by the kinds of its items: one pass in C, not one per item
        if tuple in kinds:
            kinds.discard(tuple)
            if not all(is_immutable(item) for item in value if type(item) is tuple):
                return False
        return all(issubclass(kind, _IMMUTABLE) for kind in kinds)
    return isinstance(value, _IMMUTABLE)


def serialised(value: Any) -> bytes:
    """``torch.save(value)``'s bytes: an extra-state file's content."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def detached(value: Any) -> Any:
    """A copy of ``value`` that later changes to the objects it came from cannot reach: tensors cloned,
    dicts, lists and tuples rebuilt, immutable values shared, anything else deep-copied (an async save's
    extra state, serialised later in the background; a few KB of RNG states, where ``torch.save`` on
    the loop's path cost about a millisecond)."""
    if is_immutable(value):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) is dict:
        return {key: detached(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(detached(item) for item in value)
    return copy.deepcopy(value)


def _wants_pinned(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and torch.cuda.is_available()


def allocate_each(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=_wants_pinned(t)) for t in sources]
