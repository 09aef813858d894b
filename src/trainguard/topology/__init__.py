"""Topology: mesh degrees, rank coordinates, the device mesh and replica groups."""

from trainguard._lazy import lazy_exports

_EXPORTS = {
    "group_info": ("GROUP_INFO_NAME", "GroupInfo", "read_group_info", "restore_group_info_list"),
    "layout": ("MESH_DIMS", "Layout", "resolve_layout"),
    "replica_groups": ("DEVICE_MESH_ORDER", "MEGATRON_ORDER", "ReplicaGroups", "device_mesh_replica_groups",
                       "megatron_replica_groups"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
