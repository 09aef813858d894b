"""Pages of a memory-mapped rank file are given back after reading, and the tensors still read right."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainguard.merge import mapped_pages
from trainguard.checkpoint.safe_load import safe_torch_load

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")


def resident_bytes_of(path: Path) -> int:
    """The resident set of this process's mappings of ``path`` (from /proc/self/smaps)."""
    target, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5] == target
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_released_pages_leave_the_resident_set_and_reads_stay_correct(tmp_path):
    expected = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"w": expected}, path)
    loaded = safe_torch_load(path, mmap=True)["w"]
    ranges = mapped_pages.private_read_mappings(path)
    assert ranges, "torch.load(mmap=True) should have mapped the file"
    assert torch.equal(loaded, expected)
    assert resident_bytes_of(path) >= expected.nbytes // 2
    mapped_pages.release(ranges)
    assert resident_bytes_of(path) < expected.nbytes // 8
    assert torch.equal(loaded, expected)  # faulted back in from the file
