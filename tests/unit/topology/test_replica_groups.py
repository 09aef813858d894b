"""Replica-group math over random layouts (both rank orders), and group_info.json."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import CheckpointError
from trainguard.topology import (
    DEVICE_MESH_ORDER,
    GroupInfo,
    device_mesh_replica_groups,
    megatron_replica_groups,
    read_group_info,
    restore_group_info_list,
)
from trainguard.topology.replica_groups import megatron_coordinates, row_major_coordinates

degree = st.integers(min_value=1, max_value=4)


def assert_partition(groups, world_size):
    ranks = sorted(r for g in groups for r in g)
    assert ranks == list(range(world_size))


@st.composite
def meshes(draw):
    names = draw(st.permutations(DEVICE_MESH_ORDER))
    names = names[: draw(st.integers(min_value=1, max_value=len(names)))]
    return [draw(degree) for _ in names], list(names)


@settings(max_examples=200, deadline=None)
@given(meshes())
def test_device_mesh_groups_partition_ranks_and_vary_only_in_dp_replicate(mesh):
    shape, names = mesh
    groups = device_mesh_replica_groups(shape, names)
    world = math.prod(shape)
    replicate = shape[names.index("dp_replicate")] if "dp_replicate" in names else 1
    for partition in (groups.model, groups.optim):
        assert_partition(partition, world)
        assert all(len(g) == replicate for g in partition)
    for group in groups.model:
        coords = [row_major_coordinates(r, shape) for r in group]
        for i, name in enumerate(names):
            values = {c[i] for c in coords}
            assert len(values) == (replicate if name == "dp_replicate" else 1)


@st.composite
def megatron_layouts(draw):
    degrees = {name: draw(degree) for name in ("tp", "cp", "ep", "dp", "pp")}
    domain = degrees["dp"] * degrees["cp"]
    shard = draw(st.sampled_from([d for d in range(1, domain + 1) if domain % d == 0]))
    return degrees, shard


@settings(max_examples=200, deadline=None)
@given(megatron_layouts())
def test_megatron_groups_follow_the_degrees(layout):
    degrees, shard = layout
    groups = megatron_replica_groups(**degrees, optimizer_shard=shard)
    world = math.prod(degrees.values())
    domain = degrees["dp"] * degrees["cp"]
    assert_partition(groups.model, world)
    assert_partition(groups.optim, world)
    assert all(len(g) == domain for g in groups.model)  # weights replicated over dp × cp
    assert all(len(g) == domain // shard for g in groups.optim)
    for group in groups.model:  # same tp, ep, pp coordinates
        coords = [megatron_coordinates(r, degrees) for r in group]
        assert len({(c["tp"], c["ep"], c["pp"]) for c in coords}) == 1
    for group in groups.optim:  # every optimizer group lies inside one weight group
        assert any(set(group) <= set(m) for m in groups.model)


def test_the_four_cases_of_reference_001():
    # 1. data parallel, optimizer parallelism off: all dp ranks hold the same slices
    off = megatron_replica_groups(dp=8)
    assert off.model_replicas(0) == off.optim_replicas(0) == list(range(8))
    # 2. model parallelism: tp ranks hold different slices
    tp = megatron_replica_groups(tp=2, dp=4)
    assert tp.model_replicas(0) == [0, 2, 4, 6] and tp.model_replicas(1) == [1, 3, 5, 7]
    # 3. optimizer shards = dp: no two ranks hold the same optimizer shard (or weights, MindSpore-style)
    full = megatron_replica_groups(dp=8, optimizer_shard=8, shard_weights=True)
    assert full.optim_replicas(3) == [3] and full.model_replicas(3) == [3]
    # 4. optimizer shards < dp: same position in different shard groups holds the same slice
    part = megatron_replica_groups(dp=8, optimizer_shard=4, shard_weights=True)
    assert part.model_replicas(0) == [0, 4] and part.optim_replicas(5) == [1, 5]
    # tp is fastest in Megatron's order; dp_replicate is outermost-but-pp in the DeviceMesh order
    hsdp = device_mesh_replica_groups([2, 4], ["dp_replicate", "dp_shard"])
    assert hsdp.model_replicas(0) == [0, 4]


def test_bad_degrees_are_refused():
    with pytest.raises(ValueError, match="optimizer_shard=3"):
        megatron_replica_groups(dp=4, optimizer_shard=3)
    with pytest.raises(ValueError, match="names"):
        device_mesh_replica_groups([2], ["data"])


def test_group_info_round_trip_and_restore_list(tmp_path):
    groups = device_mesh_replica_groups([2, 4], ["dp_replicate", "dp_shard"])
    info = GroupInfo(groups, {"kind": "device_mesh"}, (0,), {r: str(tmp_path / f"rank{r}") for r in range(8)})
    path = tmp_path / "group_info.json"
    path.write_text(json.dumps(info.to_dict()))
    assert restore_group_info_list(path) == [0, 4]
    assert restore_group_info_list(tmp_path, rank=5) == [1, 5]
    assert read_group_info(path).groups == groups


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"format": "x"}', "not a trainguard group_info"),
    ('{"format": "trainguard-group-info", "version": 1, "world_size": 2, "model_groups": [[0]], '
     '"optim_groups": [[0], [1]], "ranks": {"0": {}}}', "does not partition"),
])
def test_bad_group_info_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "group_info.json"
    path.write_text(text)
    with pytest.raises(CheckpointError, match=message):
        read_group_info(path)
