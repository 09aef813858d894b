"""File checksums for manifests.

``xxh3_64``, which hashes faster than disks read, so verifying a checkpoint costs about one
sequential read of it: every file a stream writes (the durable tier's, the local tier's) is hashed as
it is written. ``xxh3_64_pieces``: the xxh3_64 of the 8-byte big-endian xxh3_64 digests of the file's
consecutive 64 MiB pieces (the last one shorter), for a file that lies whole in memory when it is
hashed (the memory tier's files, mapped in ``/dev/shm``): its pieces are hashed by several threads at
once (xxhash lets go of the GIL), where one thread hashing a step's state took about as long as a GPU
step (benchmarks/RESULTS-gpu.md). A file is verified with the algorithm its manifest names.
"""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
PIECES_ALGORITHM = "xxh3_64_pieces"
CHECKSUM_ALGORITHMS = (CHECKSUM_ALGORITHM, PIECES_ALGORITHM)
PIECE_BYTES = 64 << 20
HASH_THREADS = 8
# Large reads keep per-call overhead negligible on multi-GiB shards.
_BUFFER_SIZE = 8 << 20


def file_checksum(path: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """``"<algorithm>:<16 hex digits>"`` of the file's bytes."""
    if algorithm == PIECES_ALGORITHM:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size == 0:
                return pieces_checksum(memoryview(b""))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as whole:
                return pieces_checksum(whole)
    if algorithm != CHECKSUM_ALGORITHM:
        raise ValueError(f"unsupported checksum algorithm {algorithm!r}: expected {CHECKSUM_ALGORITHM} or "
                         f"{PIECES_ALGORITHM}")
    digest = xxhash.xxh3_64()
    buffer = bytearray(_BUFFER_SIZE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def pieces_checksum(data: memoryview) -> str:
    """``xxh3_64_pieces`` of ``data`` (see the module's doc), its pieces hashed in parallel."""
    pieces = [data[start:start + PIECE_BYTES] for start in range(0, data.nbytes, PIECE_BYTES)]
    hash_all = _hash_pool().map if len(pieces) > 1 else map
    digests = hash_all(xxhash.xxh3_64_digest, pieces)
    return f"{PIECES_ALGORITHM}:{xxhash.xxh3_64_hexdigest(b''.join(digests))}"


@functools.cache
def _pool_of(pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(HASH_THREADS, os.cpu_count() or 1), thread_name_prefix="trainguard-hash")


def _hash_pool() -> ThreadPoolExecutor:
    """This process's hashing threads (a forked writer process makes its own)."""
    return _pool_of(os.getpid())


def checksum_matches(path: str | os.PathLike, expected: str) -> bool:
    algorithm, _, _ = expected.partition(":")
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(f"unsupported checksum {expected!r}: expected {CHECKSUM_ALGORITHM}:<hex> or "
                         f"{PIECES_ALGORITHM}:<hex>")
    return file_checksum(path, algorithm) == expected
