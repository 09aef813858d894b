"""Storage check of a checkpoint directory: write a file, fsync it, read it back, compare, time both ways.

The file is named ``.trainguard-doctor-<token>`` (no checkpoint tool looks at it) and is always removed.
After the fsync its pages are dropped from the page cache where the kernel allows it, so the read comes
from the storage, not from memory.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np

from trainguard.fs.fsio import fsync_dir
from trainguard.doctor.report import CheckResult

_CHUNK = 4 << 20


def _chunk(index: int, pattern: bytes) -> bytes:
    # each chunk starts with its own number, so a block written or read at the wrong place is caught
    return index.to_bytes(8, "little") + pattern[8:]


def check_storage(directory: str | os.PathLike, size_mb: int = 64, *, min_write_mb_s: float | None = None) -> CheckResult:
    directory = Path(directory)
    target = str(directory)
    started = time.perf_counter()
    chunks = max(1, (size_mb << 20) // _CHUNK)
    pattern = np.random.default_rng(int.from_bytes(os.urandom(4), "little")).bytes(_CHUNK)
    path = directory / f".trainguard-doctor-{uuid.uuid4().hex[:12]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tick = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for index in range(chunks):
                data = memoryview(_chunk(index, pattern))
                while data:
                    data = data[os.write(fd, data):]
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fsync_dir(directory)
        write_s = time.perf_counter() - tick
        tick = time.perf_counter()
        bad_chunks = []
        with open(path, "rb", buffering=0) as f:
            for index in range(chunks):
                data = f.read(_CHUNK)
                if data != _chunk(index, pattern):
                    bad_chunks.append(index)
            trailing = f.read(1)
        read_s = time.perf_counter() - tick
    except OSError as exc:
        return CheckResult("storage", target, False, f"{type(exc).__name__}: {exc.strerror or exc}",
                           time.perf_counter() - started)
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    megabytes = chunks * _CHUNK / (1 << 20)
    write_mb_s = megabytes / write_s if write_s > 0 else float("inf")
    read_mb_s = megabytes / read_s if read_s > 0 else float("inf")
    metrics = {"megabytes": megabytes, "write_mb_s": write_mb_s, "read_mb_s": read_mb_s}
    problems = []
    if bad_chunks or trailing:
        problems.append(f"read back differs from what was written ({len(bad_chunks)} of {chunks} chunks"
                        f"{', extra bytes at the end' if trailing else ''})")
    if min_write_mb_s is not None and write_mb_s < min_write_mb_s:
        problems.append(f"write {write_mb_s:.0f} MB/s is below the minimum {min_write_mb_s:.0f} MB/s")
    detail = "; ".join(problems) or (f"{megabytes:.0f} MiB written+fsynced at {write_mb_s:.0f} MB/s, "
                                     f"read back identical at {read_mb_s:.0f} MB/s")
    return CheckResult("storage", target, not problems, detail, time.perf_counter() - started, metrics)
