"""A lazy snapshot: the copy of the live training state into staging buffers, made while the next
forward and backward run, and waited for only before the optimizer step mutates the tensors.

Parameters and optimizer state do not change between an optimizer step and the next one, so a save
taken right after a step need not copy them before it returns (CheckFreq, DataStates-LLM, torchtitan's
zero-overhead mode). ``LazySnapshot`` receives the ``(buffer, source)`` pairs of a staging plan, sorted
once per plan (``CopySplit``), and:

- copies at once every source that is not a parameter or optimizer state (module buffers, such as
  running statistics, may change in the forward pass; they are small);
- on CPU, splits the other copies into chunks that any thread may take: the save's background thread
  copies them, and ``wait()`` (the training thread, right before the optimizer step) takes whatever
  chunks are left instead of idling, then waits for the chunks being copied;
- on CUDA, enqueues the copies into pinned host buffers on a side stream ordered after the training
  stream; ``wait()`` makes the training stream wait for them (no host blocking), and the background
  thread waits on the host before it reads the buffers. (This path is written for CUDA machines and
  not exercised by the CPU-only tests.)

Only ``wait()`` makes the live tensors free to change; ``copied()`` makes the buffers safe to read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

CHUNK_BYTES = 8 << 20
"""Copies are split into pieces of about this size: small enough that the thread waiting before the
optimizer step finds work to share, large enough that taking a chunk costs nothing beside copying it."""


def mutable_by_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Storage addresses of the tensors only the optimizer step changes: every parameter (its local
    shard for a ``DTensor``) and every tensor of the optimizer's state."""
    tensors: list[torch.Tensor] = [p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {local_tensor(t).data_ptr() for t in tensors}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard; any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


@dataclass(frozen=True)
class CopySplit:
    """A staging plan's ``(buffer, source)`` copies sorted by when they are made: ``now`` (sources
    that are not parameters or optimizer state), later on CPU, later on a CUDA side stream. Sorting
    reads every source's storage and device, so a plan kept between saves keeps its split too."""
    now: list[tuple[torch.Tensor, torch.Tensor]]
    later_cpu: list[tuple[torch.Tensor, torch.Tensor]]
    later_cuda: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, copies: Iterable[tuple[torch.Tensor, torch.Tensor]], lazy: set[int]) -> "CopySplit":
        """``copies``: ``(buffer, source)`` pairs; sources whose ``data_ptr()`` is in ``lazy`` are
        copied later, the others now."""
        split = cls([], [], [])
        for buffer, source in copies:
            if source.data_ptr() not in lazy:
                split.now.append((buffer, source.detach()))
            elif source.device.type == "cuda":
                split.later_cuda.append((buffer, source.detach()))
            else:
                split.later_cpu.append((buffer, source))
        return split


class LazySnapshot:
    def __init__(self, split: CopySplit, chunk_bytes: int = CHUNK_BYTES):
        """Makes ``split.now``'s copies; the others are made later (see the module's doc)."""
        for buffer, source in split.now:
            buffer.copy_(source)
        self._deferred, self._chunk_bytes = split.later_cpu, chunk_bytes
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # cut by the first thread to copy
        self._next = 0
        self._unfinished = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._cuda_event = _enqueue_on_side_stream(split.later_cuda) if split.later_cuda else None
        if not split.later_cpu:
            self._done.set()

    def copy(self) -> None:
        """Copies chunks until none is left to take (any number of threads may call it)."""
        while True:
            with self._lock:
                if self._chunks is None:  # here, not in __init__: off the path of the save() that made it
                    self._chunks = [chunk for buffer, source in self._deferred
                                    for chunk in _chunks(buffer, source.detach(), self._chunk_bytes)]
                    self._unfinished = len(self._chunks)
                if self._next >= len(self._chunks) or self._error is not None:
                    return
                buffer, source = self._chunks[self._next]
                self._next += 1
            try:
                buffer.copy_(source)
            except BaseException as exc:
                self._error = exc
                self._done.set()
                raise
            with self._lock:
                self._unfinished -= 1
                if not self._unfinished:
                    self._done.set()

    def wait(self) -> None:
        """Returns once the live tensors may change: helps with the chunks left, then waits for the
        ones being copied (CPU); orders the current CUDA stream after the copies (CUDA)."""
        self.copy()
        self._done.wait()
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)
        if self._error is not None:
            raise self._error

    def copied(self) -> None:
        """Returns once every byte is in the buffers (the reader's side: blocks on the host for CUDA)."""
        self.copy()
        self._done.wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        if self._error is not None:
            raise self._error


def _chunks(buffer: torch.Tensor, source: torch.Tensor, chunk_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not source.is_contiguous() or source.nbytes <= chunk_bytes:
        return [(buffer, source)]
    flat_buffer, flat_source = buffer.view(-1), source.view(-1)
    step = max(1, chunk_bytes // source.element_size())
    return [(flat_buffer[i : i + step], flat_source[i : i + step]) for i in range(0, source.numel(), step)]


def _enqueue_on_side_stream(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
    """Device-to-host copies into pinned buffers on a side stream that first waits for everything the
    training stream has enqueued so far (the optimizer step of the step saved)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for buffer, source in copies:
            buffer.copy_(source, non_blocking=True)
    done = torch.cuda.Event()
    done.record(side)
    return done


class StagingGate:
    """The snapshot a saver has in flight, and the optimizers whose steps wait for it: a step pre-hook
    on each optimizer that was saved makes ``optimizer.step()`` wait, so no step can change a tensor
    before it is copied, even in a loop that never calls ``wait()`` itself."""

    def __init__(self) -> None:
        self._snapshot: LazySnapshot | None = None
        self._hooked: set[int] = set()

    def hold(self, snapshot: LazySnapshot, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._hooked:
            self._hooked.add(id(optimizer))
            optimizer.register_step_pre_hook(self._before_step)
        self._snapshot = snapshot

    def _before_step(self, *_: object) -> None:
        self.wait()

    def wait(self) -> float:
        """Blocks until the live tensors may change again; returns the seconds it blocked. A failed
        copy is not raised here: the save's writer meets it too, and the save reports it."""
        if self._snapshot is None:
            return 0.0
        snapshot, self._snapshot = self._snapshot, None
        started = time.perf_counter()
        try:
            snapshot.wait()
        except Exception:
            pass
        return time.perf_counter() - started
