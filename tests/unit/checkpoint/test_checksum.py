"""The manifests' checksums: ``xxh3_64`` of a file's bytes, and ``xxh3_64_pieces`` (the memory tier's,
its 64 MiB pieces hashed on several threads), each verified by the algorithm its entry names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from trainguard.checkpoint.checksum import PIECE_BYTES, checksum_matches, file_checksum, pieces_checksum
from trainguard.checkpoint.local.writer import BytesMismatch, write_file_durably
from trainguard.checkpoint.manifest import FileEntry


@pytest.fixture(scope="module")
def three_pieces() -> bytes:
    """Two whole pieces and a short third: the threads' path, and a last piece that is not whole."""
    return os.urandom(1 << 20) * (PIECE_BYTES >> 20) + os.urandom(1 << 20) * (PIECE_BYTES >> 20) + os.urandom(4099)


def test_pieces_checksum_is_the_hash_of_the_pieces_digests_in_order(three_pieces: bytes) -> None:
    pieces = [three_pieces[start:start + PIECE_BYTES] for start in range(0, len(three_pieces), PIECE_BYTES)]
    assert [len(p) for p in pieces] == [PIECE_BYTES, PIECE_BYTES, 4099]
    expected = xxhash.xxh3_64_hexdigest(b"".join(xxhash.xxh3_64(p).digest() for p in pieces))
    assert pieces_checksum(memoryview(three_pieces)) == f"xxh3_64_pieces:{expected}"
    swapped = pieces[1] + pieces[0] + pieces[2]  # the same pieces in another order: another checksum
    assert pieces_checksum(memoryview(swapped)) != pieces_checksum(memoryview(three_pieces))


def test_a_file_is_verified_by_the_algorithm_its_entry_names(tmp_path: Path, three_pieces: bytes) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(three_pieces)
    whole, pieced = file_checksum(path), file_checksum(path, "xxh3_64_pieces")
    assert whole == f"xxh3_64:{xxhash.xxh3_64_hexdigest(three_pieces)}"
    assert pieced == pieces_checksum(memoryview(three_pieces))
    assert checksum_matches(path, whole) and checksum_matches(path, pieced)
    with path.open("r+b") as f:  # one bit of the last piece flipped
        f.seek(len(three_pieces) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    assert not checksum_matches(path, whole) and not checksum_matches(path, pieced)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert checksum_matches(empty, pieces_checksum(memoryview(b"")))
    with pytest.raises(ValueError, match="unsupported checksum 'md5:"):
        checksum_matches(path, "md5:0123")


def test_a_received_memory_tier_file_is_checked_against_its_pieces_checksum(tmp_path: Path) -> None:
    """A rank receiving a replica's file writes it with the sender's entry: an ``xxh3_64_pieces`` one is
    checked by that algorithm (the stream's own hash is ``xxh3_64``), and wrong bytes never take its name."""
    data = os.urandom(100_000)
    entry = FileEntry("model.pt", len(data), pieces_checksum(memoryview(data)))
    written = write_file_durably(tmp_path / "model.pt", lambda stream: stream.write(data), entry)
    assert written.checksum == entry.checksum and (tmp_path / "model.pt").read_bytes() == data
    with pytest.raises(BytesMismatch):
        write_file_durably(tmp_path / "other.pt", lambda stream: stream.write(data[:-1] + b"x"), entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
