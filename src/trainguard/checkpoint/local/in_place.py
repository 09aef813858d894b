"""The memory tier's state files, staged in place: the lazy snapshot copies each tensor straight into
the file it will be committed as.

A step's model and optimizer files are ``torch.save`` archives (``save_tensor``): each tensor's bytes
are one record, at an offset set by what precedes it (the pickle, the records' headers, their 64-byte
alignment), never by the bytes themselves. So ``InPlaceStaging`` plans the offsets once per layout (the
state serialised around placeholders whose memory is never touched), maps the rank's spare file of
each kind (uncommitted, in ``spare/``: the file the next step is committed as) and gives the lazy
snapshot ``(slice of the mapped file, live tensor)`` pairs to copy. The writer (``commit_staged``, in
the writer process or the training process) moves the file into the step under a temporary name and
serialises the state again over its own mapping of it: each record whose bytes already lie where the
archive puts them is left there, everything else (headers, the pickle) is written around them; then it
hashes the whole file (``xxh3_64_pieces``: its 64 MiB pieces on several threads), fsyncs it and renames
it to its name in the step. Per step the state is copied
once and hashed once, where it was copied into staging buffers, copied again into the file and hashed.
A state on CUDA is copied the same way, by the side stream, into mappings page-locked for CUDA (once
per mapping): the spare files live in node memory (tmpfs), whose pages can be locked as the staging
arenas' are.

The file committed is the same, byte for byte, as ``save_tensor`` writes (the same serialiser runs
over it), and is committed as any other (renamed into the step after its fsync; the rank's manifest,
with its checksum, last). If the layout moved (a plain value whose pickle changed length), a record
would be out of place: the writer then writes a new file the usual way from the same bytes and the
next save plans again.
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from trainguard.checkpoint.checksum import pieces_checksum
from trainguard.checkpoint.hashing_file import save_tensor
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.shared_buffers import page_lock, page_unlock
from trainguard.checkpoint.snapshot import CopySplit
from trainguard.checkpoint.staging import StagingPlan
from trainguard.fs.layout import TEMP_MARKER, new_token

_LAYOUTS = itertools.count()
"""Each plan's number, unique in the process: a mapping's tensors are built for one plan."""


@dataclass(frozen=True)
class FileSlice:
    """A tensor of a staged file, by position: what the writer rebuilds it from over its mapping."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StagedFile:
    """A state file staged in place: ``state`` with each staged tensor as its ``FileSlice``."""

    path: Path
    size: int
    state: dict[str, Any]


class _Mapped:
    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size)
        self.address = _address(memoryview(self.map))
        self.page_locked = False
        self.layout = -1
        self.views: dict[int, torch.Tensor] = {}  # the staged tensors over this mapping, by planned buffer
        # (its id: the buffers stay held while planned), for ``layout``


class MappedFiles:
    """This process's mappings of staged files, one per inode, kept while the inode lives: the spares
    rotate through a few inodes (the files of the steps kept, and the spare), and a mapping made once
    is not faulted in again at every step."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, int], _Mapped] = {}
        self._lock = threading.Lock()  # tiers of one process may stage and commit at the same time
        self.page_locks = 0
        """Mappings page-locked so far (each a new inode's: benchmarks count them, steady state makes none)."""

    def open(self, path: Path, size: int, *, create: bool = False, page_locked: bool = False) -> _Mapped:
        """The mapping of ``path``; with ``create``, the file is made (or cut, or grown) to ``size`` first;
        with ``page_locked``, the mapping is page-locked for CUDA's copies into it (once per mapping: the
        spares' inodes are reused, step after step)."""
        with self._lock:
            mapped = self._open(path, size, create)
            if page_locked and not mapped.page_locked:
                page_lock(mapped.address, mapped.size)
                mapped.page_locked = True
                self.page_locks += 1
            return mapped

    def _open(self, path: Path, size: int, create: bool) -> _Mapped:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0) | os.O_CLOEXEC, 0o644)
        try:
            status = os.fstat(fd)
            if create and status.st_size != size:
                self._forget((status.st_dev, status.st_ino))  # before a cut: no access beyond its end
                os.ftruncate(fd, size)
            elif status.st_size != size:
                raise ValueError(f"{path}: {status.st_size} bytes, staged as {size}")
        except BaseException:
            os.close(fd)
            raise
        key = (status.st_dev, status.st_ino)
        kept = self._files.get(key)
        if kept is not None and kept.size == size:
            os.close(fd)
            return kept
        self._forget(key)
        self._files[key] = mapped = _Mapped(fd, size)
        for other in [k for k, m in self._files.items() if os.fstat(m.fd).st_nlink == 0]:
            self._forget(other)  # a deleted inode's pages live as long as a mapping of them
        return mapped

    def _forget(self, key: tuple[int, int]) -> None:
        mapped = self._files.pop(key, None)
        if mapped is not None:  # the mapping itself goes with the last tensor over it
            if mapped.page_locked:  # a deleted inode's pages would stay held while locked
                page_unlock(mapped.address)
            os.close(mapped.fd)


MAPPED = MappedFiles()
"""The mappings of this process (the training process's, or its writer process's)."""

_AROUND_RECORDS: dict[Path, tuple[bytes, list[tuple[int, bytes]]]] = {}
"""Per staged file, what the last in-place commit wrote around the records (headers, pickle), and for
which state (its plain values and records' places, pickled): the same state serialises to the same
bytes (the model's DTensor layouts, the one other input, are the tier's for its life), so the serialiser
runs again only when a plain value changed (a scheduler's learning rate) or the layout did."""


def _tensor(mapping: mmap.mmap, ref: FileSlice) -> torch.Tensor:
    count = 1
    for size in ref.shape:
        count *= size
    return torch.frombuffer(mapping, dtype=ref.dtype, count=count, offset=ref.offset).view(ref.shape)


def _address(view: memoryview) -> int:
    return numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0]


class _Recorder:
    """A file-like object the serialiser writes to: notes where each record of ``wanted`` (data
    address -> index) goes, and keeps nothing."""

    def __init__(self, wanted: dict[int, int]):
        self.wanted, self.position, self.found = wanted, 0, {}

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes:
            index = self.wanted.get(_address(view))
            if index is not None:
                self.found[index] = self.position
        self.position += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        """Nothing is kept."""


class _InPlace:
    """A file-like object the serialiser writes to, over the mapping of a staged file: a write whose
    bytes are already at its position (a staged tensor's record) is left there; any other (headers,
    the pickle) is kept, to be copied in after the serialisation (so that no copy can overwrite a
    record not serialised yet). ``moved``: a write from inside the mapping that is not at its position
    (the layout moved)."""

    def __init__(self, mapped: _Mapped):
        self.base = mapped.address
        self.size, self.position, self.moved = mapped.size, 0, False
        self.writes: list[tuple[int, bytes]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data)
        count = view.nbytes
        if not count:
            return 0
        address = _address(view)
        if address == self.base + self.position:
            self.position += count
            return count
        self.moved = self.moved or self.base <= address < self.base + self.size
        if not self.moved:
            self.writes.append((self.position, bytes(view)))
        self.position += count
        return count

    def flush(self) -> None:
        """Nothing to hand on before the end."""


class InPlaceStaging:
    def __init__(self, spare_dir: Path, names: dict[str, str], wrap: dict[str, Callable[[dict[str, Any]], Any]]):
        """``spare_dir``/``names[kind]``: the file of each kind (``model``, ``optim``) a step is staged
        in; ``wrap[kind]``: what the writer serialises from the state of that kind (the model's local
        shards as DTensors)."""
        self.spare_dir, self.names, self.wrap = spare_dir, names, wrap
        self._planned: list[torch.Tensor] = []  # the buffers planned for (held: their ids stay theirs)
        self._slices: dict[int, tuple[str, FileSlice]] = {}
        self._sizes: dict[str, int] = {}
        self._page_locked = False  # sources on CUDA: the side stream copies into the mappings
        self._layout = -1
        self.plans = 0
        """How many times the layout was planned (the first save plans)."""

    def replan(self) -> None:
        """The layout moved: the next ``stage`` plans again."""
        self._planned = []

    def _plan(self, plan: StagingPlan) -> None:
        buffers = [buffer for buffer, _ in plan.copies]
        self._slices, self._sizes = {}, {}
        for kind in self.names:
            own = {id(value) for value in plan.staged[kind].values() if isinstance(value, torch.Tensor)}
            wanted = {buffer.data_ptr(): index for index, buffer in enumerate(buffers)
                      if buffer.numel() and id(buffer) in own}
            recorder = _Recorder(wanted)
            save_tensor(self.wrap[kind](plan.staged[kind]), recorder)
            if set(recorder.found) != set(wanted.values()):
                raise RuntimeError(f"{kind}: {len(wanted) - len(recorder.found)} staged tensors are not records "
                                   "of their own in the serialised state")
            for index, offset in recorder.found.items():
                buffer = buffers[index]
                self._slices[id(buffer)] = (kind, FileSlice(offset, buffer.dtype, tuple(buffer.shape)))
            self._sizes[kind] = recorder.position
        self._planned = buffers
        self._page_locked = any(source.device.type == "cuda" for _, source in plan.copies)
        self._layout = next(_LAYOUTS)
        self.plans += 1

    def stage(self, plan: StagingPlan, split: CopySplit) -> tuple[CopySplit, dict[str, StagedFile]]:
        """The lazy snapshot's copies, ``split`` (``plan.copies`` sorted by when they are made) with each
        buffer replaced by its slice of a staged file, and the staged files to commit once they are made.
        ``plan``: the staging plan around placeholder buffers (shaped like the state, never written:
        ``placeholders``)."""
        if len(self._planned) != len(plan.copies) or any(a is not b for a, (b, _) in zip(self._planned, plan.copies)):
            self._plan(plan)
        self.spare_dir.mkdir(parents=True, exist_ok=True)
        mapped = {kind: MAPPED.open(self.spare_dir / name, self._sizes[kind], create=True,
                                    page_locked=self._page_locked) for kind, name in self.names.items()}

        def in_files(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            placed = []
            for buffer, source in copies:
                place = self._slices.get(id(buffer))
                if place is None:
                    continue  # an empty tensor: in the state as it is
                target = mapped[place[0]]
                if target.layout != self._layout:  # built once per mapping and plan
                    target.layout, target.views = self._layout, {}
                view = target.views.get(id(buffer))
                if view is None:
                    view = target.views[id(buffer)] = _tensor(target.map, place[1])
                placed.append((view, source))
            return placed

        files = {}
        for kind, name in self.names.items():
            state = {key: self._slices[id(value)][1] if isinstance(value, torch.Tensor) and id(value) in self._slices
                     else value for key, value in plan.staged[kind].items()}
            files[kind] = StagedFile(self.spare_dir / name, self._sizes[kind], state)
        return CopySplit(in_files(split.now), in_files(split.later_cpu), in_files(split.later_cuda)), files


def placeholders(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers shaped like ``sources`` that are planned around and never written: their memory is
    reserved, not touched (a ``ReusableStager``'s allocator for ``InPlaceStaging``). Not even under
    ``torch.use_deterministic_algorithms(True)``, which the trainer turns on and which fills every
    tensor ``torch.empty`` makes with NaN (a second copy of the rank's state written for nothing): a
    bare storage is not filled, and the buffer is a view of it (no process-wide setting is touched,
    which another thread allocating meanwhile would see)."""
    return [torch.empty(0, dtype=source.dtype).set_(torch.UntypedStorage(source.numel() * source.element_size()),
                                                    0, tuple(source.shape))
            for source in sources]


def commit_staged(staged: StagedFile, target: Path, wrap: Callable[[dict[str, Any]], Any],
                  write_new: Callable[[Path, Any], FileEntry]) -> tuple[FileEntry, bool]:
    """Completes the staged file (its records are in place), hashes and fsyncs it and renames it to
    ``target``; returns its entry and True. If the layout moved, ``write_new(target, state)`` writes a
    new file from the staged bytes instead (the staged file stays a spare); returns its entry and False.
    As ``write_file_durably`` does with a spare, the file is first renamed to a temporary name beside
    ``target``: the step's directory is never empty while it is written (a node-mate's cleanup removes
    empty ones), and a crash leaves a temporary file that the next start removes."""
    mapped = MAPPED.open(staged.path, staged.size)
    temp = target.with_name(f"{target.name}{TEMP_MARKER}{new_token()}")
    os.rename(staged.path, temp)
    try:
        key = pickle.dumps((staged.size, list(staged.state.items())), protocol=pickle.HIGHEST_PROTOCOL)
        kept = _AROUND_RECORDS.get(staged.path)
        if kept is not None and kept[0] == key:
            writes = kept[1]
        else:
            state = wrap({key: _tensor(mapped.map, value) if isinstance(value, FileSlice) else value
                          for key, value in staged.state.items()})
            stream = _InPlace(mapped)
            save_tensor(state, stream)
            if stream.moved or stream.position != staged.size:
                _AROUND_RECORDS.pop(staged.path, None)
                entry = write_new(target, state)
                os.rename(temp, staged.path)  # the spare again
                return entry, False
            writes = stream.writes
            _AROUND_RECORDS[staged.path] = (key, writes)
        for position, data in writes:
            mapped.map[position : position + len(data)] = data
        with memoryview(mapped.map) as whole:
            checksum = pieces_checksum(whole)
        os.fsync(mapped.fd)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    os.replace(temp, target)
    return FileEntry(target.name, staged.size, checksum), True
