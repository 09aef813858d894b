"""Topology: mesh degrees, rank coordinates, the device mesh and replica groups."""

from trainguard.topology.group_info import GROUP_INFO_NAME, GroupInfo, read_group_info, restore_group_info_list
from trainguard.topology.layout import MESH_DIMS, Layout, resolve_layout
from trainguard.topology.replica_groups import (
    DEVICE_MESH_ORDER,
    MEGATRON_ORDER,
    ReplicaGroups,
    device_mesh_replica_groups,
    megatron_replica_groups,
)

__all__ = [
    "DEVICE_MESH_ORDER",
    "GROUP_INFO_NAME",
    "MEGATRON_ORDER",
    "MESH_DIMS",
    "GroupInfo",
    "Layout",
    "ReplicaGroups",
    "device_mesh_replica_groups",
    "megatron_replica_groups",
    "read_group_info",
    "resolve_layout",
    "restore_group_info_list",
]
