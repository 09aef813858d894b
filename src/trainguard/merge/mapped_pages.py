"""Giving back the pages of a memory-mapped checkpoint file once they were read.

``torch.load(mmap=True)`` maps a rank file privately: reading a tensor faults its pages in, and they
stay in the process's resident set until the mapping goes. Mapping and unpickling a file again for
each budget of bytes read costs more than the merge itself, so a file is loaded once and its pages are
dropped from this process with ``madvise(MADV_DONTNEED)`` instead. For a private file mapping whose
pages were never written that is only a hint: they stay in the page cache, and a later read faults
them back in from the file, so a tensor still being read stays correct. Linux only; elsewhere
nothing is released (the pages are clean and file-backed, so the kernel can still reclaim them).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_MADV_DONTNEED = 4
_PROC_MAPS = Path("/proc/self/maps")


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if _PROC_MAPS.exists() else None


def private_read_mappings(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's private mappings of ``path`` that are not executable."""
    if _LIBC is None:
        return []
    target = os.path.realpath(path)
    ranges = []
    with open(_PROC_MAPS) as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target and fields[1][3] == "p" and "x" not in fields[1]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def release(ranges: list[tuple[int, int]]) -> None:
    """Drops the pages of ``ranges`` (from ``private_read_mappings``) from the resident set."""
    for start, end in ranges:
        _LIBC.madvise(start, end - start, _MADV_DONTNEED)
