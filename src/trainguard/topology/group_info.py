"""``group_info.json``: the replica groups, next to the local checkpoints of the ranks that share a
directory (reference 001's ``group_info.pb``, as JSON).

Layout of the file::

    {"format": "trainguard-group-info", "version": 1, "world_size": 4,
     "layout": {"kind": "device_mesh", "mesh_shape": [1, 2, 2, 1], "mesh_dim_names": [...]},
     "model_groups": [[0, 2], [1, 3]], "optim_groups": [[0, 2], [1, 3]],
     "ranks": {"2": {"model_replicas": [0, 2], "optim_replicas": [0, 2]}, ...},
     "rank_dirs": {"0": "/.../local/node0", ...}}

``ranks`` lists the ranks whose checkpoints live in this directory; ``rank_dirs`` where every rank's
local directory was when the run wrote it (offline repair recreates a lost one there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.fs.bounded import read_format_json
from trainguard.errors import CheckpointError
from trainguard.topology.replica_groups import ReplicaGroups

GROUP_INFO_NAME = "group_info.json"
FORMAT = "trainguard-group-info"
VERSION = 1


@dataclass(frozen=True)
class GroupInfo:
    groups: ReplicaGroups
    layout: dict[str, Any]
    ranks: tuple[int, ...]
    rank_dirs: dict[int, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.groups.world_size,
            "layout": self.layout,
            "model_groups": [list(g) for g in self.groups.model],
            "optim_groups": [list(g) for g in self.groups.optim],
            "ranks": {str(r): {"model_replicas": self.groups.model_replicas(r),
                               "optim_replicas": self.groups.optim_replicas(r)} for r in self.ranks},
            "rank_dirs": {str(r): d for r, d in sorted(self.rank_dirs.items())},
        }


def _partition(value: Any, world_size: int, key: str, path: Path) -> tuple[tuple[int, ...], ...]:
    groups = value.get(key) if isinstance(value, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and g and all(isinstance(r, int) and not isinstance(r, bool) for r in g) for g in groups
    ):
        raise CheckpointError(f"{path}: key {key!r} should be a list of non-empty lists of ranks")
    ranks = sorted(r for g in groups for r in g)
    if ranks != list(range(world_size)):
        raise CheckpointError(f"{path}: key {key!r} does not partition ranks 0..{world_size - 1}")
    return tuple(sorted(tuple(sorted(g)) for g in groups))


def read_group_info(path: str | Path) -> GroupInfo:
    """Reads and validates ``group_info.json`` (or the one in directory ``path``); one-line errors."""
    path = Path(path)
    if path.is_dir():
        path = path / GROUP_INFO_NAME
    data = read_format_json(path, FORMAT, VERSION, "group_info file", missing="missing (no replica group information)")
    world_size = data.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise CheckpointError(f"{path}: key 'world_size' should be an integer >= 1")
    groups = ReplicaGroups(world_size, _partition(data, world_size, "model_groups", path),
                           _partition(data, world_size, "optim_groups", path))
    ranks, rank_dirs = data.get("ranks"), data.get("rank_dirs", {})
    if not isinstance(ranks, dict) or not ranks or not all(k.isdigit() and int(k) < world_size for k in ranks):
        raise CheckpointError(f"{path}: key 'ranks' should map ranks below {world_size} to their groups")
    if not isinstance(rank_dirs, dict) or not all(k.isdigit() and isinstance(v, str) for k, v in rank_dirs.items()):
        raise CheckpointError(f"{path}: key 'rank_dirs' should map ranks to directories")
    layout = data.get("layout") if isinstance(data.get("layout"), dict) else {}
    return GroupInfo(groups, layout, tuple(sorted(int(k) for k in ranks)), {int(k): v for k, v in rank_dirs.items()})


def restore_group_info_list(path: str | Path, rank: int | None = None) -> list[int]:
    """The ranks whose model shard is bit-identical to ``rank``'s (itself included), e.g. ``[0, 4]``.

    ``rank`` defaults to the (lowest) rank whose checkpoint lives next to the file: with a per-rank
    local directory (``{rank}`` in ``checkpoint.local_dir``) that is the file's own rank, as in
    reference 001's ``restore_group_info_list("./checkpoints/rank_0/group_info.pb")``.
    """
    info = read_group_info(path)
    return info.groups.model_replicas(info.ranks[0] if rank is None else rank)
