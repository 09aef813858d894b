"""Offline repair on a hand-built local set (three replicas of one shard, one rank per node directory):
a corrupt source is never copied, the next replica is used instead, and a file found corrupt only by
the final sweep is repaired too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.fs.fsio import atomic_write_json
from trainguard.checkpoint.checksum import file_checksum
from trainguard.checkpoint.local.repair import discover, repair_step
from trainguard.checkpoint.local.writer import save_rank_step
from trainguard.topology.group_info import GROUP_INFO_NAME, GroupInfo
from trainguard.topology.replica_groups import device_mesh_replica_groups

WORLD = 3
STEP = 5


def model_file(root: Path, rank: int) -> Path:
    return root / f"node{rank}" / f"global_step_{STEP}" / f"model_world_size_{WORLD}_rank_{rank}.pt"


@pytest.fixture
def three_replicas(tmp_path: Path) -> Path:
    groups = device_mesh_replica_groups([WORLD, 1], ["dp_replicate", "dp_shard"])
    dirs = {rank: tmp_path / f"node{rank}" for rank in range(WORLD)}
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    for rank, directory in dirs.items():
        owner = (rank - 1) % WORLD  # the rank whose extra state this one keeps (its buddy is the next)
        save_rank_step(directory, STEP, rank=rank, world_size=WORLD, model_state=weights,
                       optim_state={"m": weights["w"] * 2}, extra_state=f"extra {rank}".encode(),
                       replica_extras={owner: f"extra {owner}".encode()}, fsdp_config={"world_size": WORLD})
        info = GroupInfo(groups, {"kind": "device_mesh"}, (rank,), {r: str(d) for r, d in dirs.items()})
        atomic_write_json(directory / GROUP_INFO_NAME, info.to_dict())
    return tmp_path


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_source_is_skipped_for_an_intact_replica(three_replicas):
    intact = model_file(three_replicas, 2).read_bytes()
    model_file(three_replicas, 0).unlink()
    flip_a_byte(model_file(three_replicas, 1))  # the first donor the plan picks for rank 0
    result = repair_step(discover(three_replicas), STEP)
    assert result.verified and result.plan.recoverable
    assert model_file(three_replicas, 0).read_bytes() == intact
    assert model_file(three_replicas, 1).read_bytes() == intact
    assert {(a.transfer.src, a.transfer.dst) for a in result.actions} == {(2, 0), (2, 1)}
    assert repair_step(discover(three_replicas), STEP).actions == []


def test_every_replica_corrupt_is_lost_and_nothing_corrupt_is_copied(three_replicas):
    model_file(three_replicas, 0).unlink()
    for rank in (1, 2):
        flip_a_byte(model_file(three_replicas, rank))
    result = repair_step(discover(three_replicas), STEP)
    assert not result.plan.recoverable and not result.verified
    assert result.plan.lost_ranks == [0, 1, 2]
    assert not model_file(three_replicas, 0).exists()


def test_files_not_used_as_sources_are_still_checked(three_replicas):
    optim = three_replicas / "node2" / f"global_step_{STEP}" / f"optim_world_size_{WORLD}_rank_2.pt"
    flip_a_byte(optim)
    result = repair_step(discover(three_replicas), STEP)
    assert result.verified and [a.transfer.dst_path for a in result.actions] == [optim.name]
    assert file_checksum(optim) == file_checksum(optim.parents[2] / "node0" / f"global_step_{STEP}" /
                                                 f"optim_world_size_{WORLD}_rank_0.pt")
