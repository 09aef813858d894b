"""Staging buffers in shared memory, which a writer process maps as well.

Every buffer of one staging layout lives in one anonymous memory file (``memfd_create``): it has no
name in ``/dev/shm`` that a killed process could leave behind, and the kernel frees it with its last
user. The writer process maps the same file through ``/proc/<training pid>/fd/<fd>``. Each buffer is
a tensor over its own slice of the mapping, so its storage is exactly its bytes, as for a tensor
allocated alone: whatever serialises it (``torch.save`` writes a tensor's whole storage) gives the
same bytes in the training process and in the writer.
"""

from __future__ import annotations

import mmap
import os
import uuid
import weakref
from dataclasses import dataclass

import torch

ALIGN = 64
"""Each buffer starts at a multiple of this many bytes (a cache line; every dtype's alignment)."""


@dataclass(frozen=True)
class ArenaRef:
    """A tensor inside an arena, by position: what the writer process rebuilds it from."""

    arena: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class SharedArena:
    def __init__(self, nbytes: int):
        self.token = uuid.uuid4().hex[:12]
        self.nbytes = max(nbytes, 1)
        self.fd = os.memfd_create("trainguard-staging", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def ref(self, tensor: torch.Tensor) -> ArenaRef | None:
        """Where ``tensor`` lies in this arena; None when it is not inside it."""
        if tensor.device.type != "cpu" or not tensor.numel():
            return None
        offset = tensor.data_ptr() - self.base
        if not 0 <= offset < self.nbytes:
            return None
        return ArenaRef(self.token, offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def allocate_shared(sources: list[torch.Tensor]) -> tuple[SharedArena, list[torch.Tensor]]:
    """A CPU buffer shaped like each source, all of them in one new arena (pinned for CUDA sources)."""
    offsets, total = [], 0
    for source in sources:
        offsets.append(total)
        total += -(-source.numel() * source.element_size() // ALIGN) * ALIGN
    arena = SharedArena(total)
    if any(source.device.type == "cuda" for source in sources) and torch.cuda.is_available():
        page_lock(arena.base, arena.nbytes)
    buffers = [_view(arena.map, offset, source.dtype, tuple(source.shape), None)
               for offset, source in zip(offsets, sources)]
    return arena, buffers


def page_lock(address: int, nbytes: int) -> None:
    """Page-locks ``nbytes`` of mapped memory from ``address`` for CUDA (``cudaHostRegister``), so that
    the side stream's device-to-host copies into it run asynchronously (into pageable memory a copy
    blocks the thread that enqueues it). Shared memory (memfd, tmpfs) can be page-locked; a file of a
    disk file system mapped for writing cannot be, for long."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def page_unlock(address: int) -> None:
    """Undoes ``page_lock`` (before the memory is unmapped, or its pages stay held)."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))


def tensor_in(mapping: mmap.mmap, ref: ArenaRef) -> torch.Tensor:
    """The tensor ``ref`` names, over the writer process's mapping of its arena."""
    return _view(mapping, ref.offset, ref.dtype, ref.shape, ref.stride)


def _view(mapping: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...],
          stride: tuple[int, ...] | None) -> torch.Tensor:
    """A tensor over ``mapping`` from ``offset``: contiguous when ``stride`` is None; its storage spans
    exactly the elements it reaches."""
    if not all(shape):
        return torch.empty(shape, dtype=dtype)
    if stride is None:
        return torch.frombuffer(mapping, dtype=dtype, count=_numel(shape), offset=offset).view(shape)
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    return torch.frombuffer(mapping, dtype=dtype, count=span, offset=offset).as_strided(shape, stride)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
