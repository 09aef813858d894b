"""Writing a new file with its manifest checksum computed on the way: no byte is read back.

``HashingFile`` is what every checkpoint writer (the durable tier's DCP writer, the local tier, the
converters) writes through; ``save_tensor`` is ``torch.save`` of one tensor into it, without the zip
CRC32s the manifest's checksums make redundant.
"""

from __future__ import annotations

import errno
import fcntl
import inspect
import mmap
import os
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM
from trainguard.fs.fsio import SYNC_FILE_RANGE_WRITE, in_memory_file_system, sync_file_range

_O_DIRECT = getattr(os, "O_DIRECT", 0)

# Large writes are handed to the kernel and hashed in pieces of this size, and the kernel is asked to
# start writing back every _WRITEBACK_CHUNK as soon as it is complete, so the disk works while later
# bytes are serialized instead of all at the closing fsync.
_PIECE = 4 << 20
_WRITEBACK_CHUNK = 16 << 20
# Smaller writes (zip headers and pickles of torch.save records, serialized objects: thousands per
# shard) are gathered into one buffer and written together, one system call per _COALESCE bytes.
_SMALL_WRITE = 64 << 10
_COALESCE = 1 << 20
# Direct writes (O_DIRECT) go through two aligned buffers of this size, in whole blocks of _BLOCK bytes:
# while the disk takes one (a direct write returns only once the bytes are on the device), the other is
# filled and hashed.
_DIRECT_BUFFER = 8 << 20
_BLOCK = 4096


def checksum_of(digest: Any) -> str:
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


class HashingFile:
    """A new file, written sequentially: every byte is hashed on its way to the disk (xxh3_64, the
    manifest's checksum), and ``close_durably`` fsyncs it and returns its size and checksum.

    On a disk file system the bytes bypass the page cache (``O_DIRECT``, through an aligned buffer):
    a checkpoint is written once and not read back by the process writing it, and copying it into
    the page cache costs the writing process several times the copy into the buffer (and the
    kernel's writeback and page reclaim cost the machine's cores more), CPU taken from training on
    a machine whose cores the ranks keep busy (``benchmarks/nostall.py --only profile``). A direct
    write lasts as long as the device takes to store it, so each full buffer is written by a writer
    thread while the caller fills the second buffer (``benchmarks/hf_trainer_save.py``: the save's
    serialisation and its disk writes overlap instead of taking turns). The last, partial block is
    padded for the write and cut off again before the fsync. Files in node memory
    (tmpfs: their pages are the file) and file systems that refuse ``O_DIRECT`` are written through
    the page cache. The bytes, and so the checksum, are the same either way."""

    def __init__(self, path: Path, *, overwrite: bool = False, direct: bool = True):
        """A new file at ``path``; with ``overwrite``, the file already there is written over from its
        start (and cut to the bytes written at ``close_durably``): a recycled file, whose pages are
        not allocated again (the memory tier's spares, ``checkpoint.local.writer.remove_rank_step``).
        ``direct=False``: through the page cache even on a disk (a writer holding many files open at
        once, each of which would pin its own aligned buffers; a synchronous save, whose loop waits for
        the whole write, which the page cache's writeback and one fsync end sooner)."""
        self.path = Path(path)
        create = 0 if overwrite else os.O_CREAT | os.O_EXCL
        self._fd = os.open(self.path, os.O_WRONLY | create | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._position = 0
        self._written_back = 0
        self._digest = xxhash.xxh3_64()
        self._pending = bytearray()  # small writes not yet handed to the kernel (already hashed)
        self._hasher: ThreadPoolExecutor | None = None
        self._aligned: mmap.mmap | None = self._direct_buffer() if direct else None
        """The aligned buffer of direct writes being filled (None: through the page cache); ``_filled``
        bytes of it are pending, and the file holds ``_on_disk`` bytes."""
        self._filled = 0
        self._on_disk = 0  # bytes the direct writes put in the file
        self._spare: mmap.mmap | None = None  # the second aligned buffer, made at the first full one
        self._disk_writer: ThreadPoolExecutor | None = None
        self._writing: Future[None] | None = None
        """The direct write of a full buffer in flight (the writer thread's), and the buffer it writes."""
        self._writing_buffer: mmap.mmap | None = None
        self._cut = overwrite  # whether close_durably cuts the file to the bytes written

    @property
    def direct(self) -> bool:
        """Whether the file is being written with ``O_DIRECT``."""
        return self._aligned is not None

    def _direct_buffer(self) -> mmap.mmap | None:
        if not _O_DIRECT or in_memory_file_system(self._fd):
            return None
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | _O_DIRECT)
        except OSError:  # a file system without direct I/O
            return None
        return mmap.mmap(-1, _DIRECT_BUFFER)  # page-aligned

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total = view.nbytes
        if total < _SMALL_WRITE:
            self._digest.update(view)
            if self._aligned is not None:
                self._stage(view)
            else:
                self._pending += view
                if len(self._pending) >= _COALESCE:
                    self._flush_pending()
            self._position += total
            return total
        self._flush_pending()
        # Hashed on a second thread while this one copies the same bytes into the page cache or the
        # aligned buffer (both release the GIL); waited for before returning, so the caller's buffer
        # outlives the hashing and the digest sees every write in file order.
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-hash")
        hashed = self._hasher.submit(self._hash_pieces, view)
        try:
            if self._aligned is not None:
                self._stage(view)
            else:
                for start in range(0, total, _PIECE):
                    self._write_out(view[start : start + _PIECE])
        finally:
            hashed.result()
        self._position += total
        self._start_writeback()
        return total

    def _hash_pieces(self, view: memoryview) -> None:
        for start in range(0, view.nbytes, _PIECE):
            self._digest.update(view[start : start + _PIECE])

    def _write_out(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def _stage(self, view: memoryview) -> None:
        """Copies ``view`` into the aligned buffer, handing the buffer to the writer thread each time it
        is full."""
        assert self._aligned is not None
        while view:
            count = min(len(view), _DIRECT_BUFFER - self._filled)
            self._aligned[self._filled : self._filled + count] = view[:count]
            self._filled += count
            view = view[count:]
            if self._filled == _DIRECT_BUFFER:
                self._write_full_buffer()
                if self._aligned is None:  # the file system refused the direct write: the rest as usual
                    self._write_out(view)
                    return

    def _write_full_buffer(self) -> None:
        """Starts the direct write of the full aligned buffer on the writer thread (once the write before
        it is done) and goes on filling the other buffer."""
        self._finish_writing()
        if self._aligned is None:  # the write before it was refused: this buffer went through the page cache
            return
        if self._disk_writer is None:
            self._disk_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-direct-write")
            self._spare = mmap.mmap(-1, _DIRECT_BUFFER)
        full = self._aligned
        self._writing_buffer = full
        self._writing = self._disk_writer.submit(self._write_buffer, full)
        self._aligned, self._spare = self._spare, full
        self._filled = 0

    def _write_buffer(self, buffer: mmap.mmap) -> None:
        with memoryview(buffer) as whole:
            self._write_out(whole)

    def _finish_writing(self) -> None:
        """Waits for the direct write in flight. A file system that refused it (EINVAL) gets its bytes,
        the pending ones and the rest of the file through the page cache."""
        writing, self._writing = self._writing, None
        if writing is None:
            return
        try:
            writing.result()
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            refused = self._writing_buffer
            assert refused is not None and self._aligned is not None
            self._disable_direct()
            with memoryview(refused) as view:
                self._write_out(view)
            self._on_disk += _DIRECT_BUFFER
            self._leave_direct()
            return
        self._on_disk += _DIRECT_BUFFER

    def _write_aligned(self, count: int) -> None:
        """Writes the buffer's first ``count`` bytes (whole blocks) directly; keeps the rest pending.
        A file system that takes ``O_DIRECT`` at open but refuses the write gets the bytes through
        the page cache, and the rest of the file too. Called with no write in flight."""
        assert self._aligned is not None and self._writing is None
        with memoryview(self._aligned) as aligned:
            try:
                self._write_out(aligned[:count])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                refused = True
            else:
                refused = False
                self._on_disk += count
                rest = self._filled - count
                aligned[:rest] = aligned[count : self._filled]
        if refused:
            self._leave_direct()  # after the view is released: the buffer cannot close while exported
            return
        self._filled = rest

    def _disable_direct(self) -> None:
        """Turns ``O_DIRECT`` off and puts the file offset after what the direct writes put there."""
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        os.lseek(self._fd, self._on_disk, os.SEEK_SET)

    def _leave_direct(self) -> None:
        """Writes what the aligned buffer holds through the page cache, and everything after it."""
        assert self._aligned is not None
        self._finish_writing()
        if self._aligned is None:  # the write in flight was refused: already left
            return
        self._disable_direct()
        aligned, self._aligned = self._aligned, None
        with memoryview(aligned) as view:
            self._write_out(view[: self._filled])
        self._filled = 0
        aligned.close()

    def _flush_pending(self) -> None:
        if self._pending:
            with memoryview(self._pending) as pending:
                self._write_out(pending)
            self._pending = bytearray()

    def _start_writeback(self) -> None:
        if self._aligned is None and sync_file_range is not None and self._position - self._written_back >= _WRITEBACK_CHUNK:
            # asynchronous: starts writeback of what is complete; durability still comes from fsync
            pending = self._position - self._written_back
            sync_file_range(self._fd, self._written_back, pending, SYNC_FILE_RANGE_WRITE)
            self._written_back = self._position

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        """Hands the kernel what can be written now (direct writes: the whole blocks pending)."""
        self._flush_pending()
        self._finish_writing()
        if self._aligned is not None and self._filled >= _BLOCK:
            self._write_aligned(self._filled - self._filled % _BLOCK)

    def fileno(self) -> int:
        """The file's descriptor, every pending byte written and direct writes left (for raw writes)."""
        self._flush_pending()
        if self._aligned is not None:
            self._leave_direct()
        return self._fd

    def close_durably(self) -> tuple[int, str]:
        self._flush_pending()
        self._finish_writing()
        if self._aligned is not None and self._filled:
            # the last block, padded to a whole one for the direct write; the padding is cut off below
            padded = -(-self._filled // _BLOCK) * _BLOCK
            self._aligned[self._filled : padded] = bytes(padded - self._filled)
            self._filled = padded
            self._cut = True
            self._write_aligned(padded)
        if self._cut:
            os.ftruncate(self._fd, self._position)  # a recycled file's old bytes, or the last block's padding
        os.fsync(self._fd)
        self.close()
        return self._position, checksum_of(self._digest)

    def close(self) -> None:
        if self._writing is not None:  # a failed save: its write is waited for, its error already raised or moot
            self._writing.exception()
            self._writing = None
        if self._disk_writer is not None:
            self._disk_writer.shutdown()
            self._disk_writer = None
        for buffer in (self._spare, self._writing_buffer):
            if buffer is not None and not buffer.closed:
                buffer.close()
        self._spare = self._writing_buffer = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        if self._aligned is not None:
            self._aligned.close()
            self._aligned = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _fast_tensor_save_available() -> bool:
    save = getattr(torch.serialization, "_save", None)
    if save is None or not hasattr(torch.serialization, "_get_storage_alignment"):
        return False
    params = list(inspect.signature(save).parameters)
    return params == ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


FAST_TENSOR_SAVE = _fast_tensor_save_available()
"""Whether ``save_tensor`` writes records without CRC32 (torch's private writer has the expected form);
otherwise it falls back to ``torch.save``, whose records carry CRC32s of their bytes."""


def save_tensor(tensor: torch.Tensor, stream: HashingFile) -> None:
    """``torch.save(tensor, stream)``, byte for byte, except that the zip records carry no CRC32.

    DCP's reader loads each record with ``torch.load``, which does not check CRC32s; computing them
    costs more than the rest of the serialization (``torch.save`` of tensors to a file runs at about
    1.6 GB/s with them and 2.8 GB/s without on the benchmark machine), and the manifest's xxh3
    checksums already guard every byte. ``torch.serialization.set_crc32_options`` would do the same process-wide (also for the
    training thread's own ``torch.save`` calls); this writer is per call. Falls back to ``torch.save``
    where the private API differs.
    """
    if not FAST_TENSOR_SAVE:
        torch.save(tensor, stream)
        return
    writer = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def write_records(path: Path, records: list[Any], *, direct: bool = True) -> tuple[list[tuple[int, int]], int, str]:
    """Writes a new file of ``records`` one after the other (bytes as they are; a tensor as
    ``save_tensor`` writes it) and fsyncs it; returns each record's ``(offset, length)``, the file's
    size and its checksum. The writer of a DCP shard and of an extra-state file, in the training
    process or in a writer process (``checkpoint.writer_process``). ``direct``: as ``HashingFile``'s."""
    stream = HashingFile(path, direct=direct)
    spans = []
    try:
        for record in records:
            offset = stream.tell()
            if isinstance(record, torch.Tensor):
                if record.untyped_storage().nbytes() != record.numel() * record.element_size():
                    record = record.clone()  # a view: save its bytes, not its whole storage
                save_tensor(record, stream)
            else:
                stream.write(record)
            spans.append((offset, stream.tell() - offset))
        size, checksum = stream.close_durably()
    finally:
        stream.close()
    return spans, size, checksum
