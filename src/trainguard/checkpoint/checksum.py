"""File checksums for manifests: xxh3-64, which hashes faster than disks read, so verifying a
checkpoint costs about one sequential read of it."""

from __future__ import annotations

import os

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
# Large reads keep per-call overhead negligible on multi-GiB shards.
_BUFFER_SIZE = 8 << 20


def file_checksum(path: str | os.PathLike) -> str:
    """``"xxh3_64:<16 hex digits>"`` of the file's bytes."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(_BUFFER_SIZE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def checksum_matches(path: str | os.PathLike, expected: str) -> bool:
    algorithm, _, _ = expected.partition(":")
    if algorithm != CHECKSUM_ALGORITHM:
        raise ValueError(f"unsupported checksum {expected!r}: expected {CHECKSUM_ALGORITHM}:<hex>")
    return file_checksum(path) == expected
