"""Where the local tier keeps each rank's files, and their names (verl's, plus a per-rank manifest).

``checkpoint.local_dir`` is a template with ``{node}`` and ``{rank}``; a relative path is relative to
the run directory. A node is a group of ``parallel.ranks_per_node`` consecutive ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainguard.fs.layout import extra_state_name, model_shard_name, optim_shard_name
from trainguard.errors import ConfigError

DEFAULT_LOCAL_DIR = "local/node{node}"
FSDP_CONFIG_NAME = "fsdp_config.json"
TORCH_VERSION_KEY = "torch_version"
"""The key of ``fsdp_config.json`` naming the torch version its step was written under."""
REPLICA_DIR = "replica"
"""Per step: copies of other ranks' extra state (``replica/extra_state_world_size_W_rank_Q.pt``)."""

SPARE_DIR = "spare"
"""Per tier directory: each rank's state files of a pruned step, written over by its next save
(``local.writer.remove_rank_step``); never part of a checkpoint."""

_RANK_FILE = re.compile(r"(model|optim|extra_state|manifest)_world_size_([0-9]+)_rank_([0-9]+)\.(pt|json)")


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def resolve_local_dir(template: str | None, run_dir: Path, *, node: int, rank: int) -> Path:
    text = template or DEFAULT_LOCAL_DIR
    try:
        resolved = text.format(node=node, rank=rank)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"config key 'checkpoint.local_dir' {text!r}: only {{node}} and {{rank}} may be "
                          f"used ({exc})") from None
    path = Path(resolved)
    return (path if path.is_absolute() else Path(run_dir) / path).resolve()


def rank_manifest_name(world_size: int, rank: int) -> str:
    return f"manifest_world_size_{world_size}_rank_{rank}.json"


def rank_file_names(world_size: int, rank: int) -> dict[str, str]:
    """The three state files of a rank, by kind."""
    return {"model": model_shard_name(world_size, rank), "optim": optim_shard_name(world_size, rank),
            "extra": extra_state_name(world_size, rank)}


def replica_extra_name(world_size: int, rank: int) -> str:
    return f"{REPLICA_DIR}/{extra_state_name(world_size, rank)}"


def parse_rank_file(name: str) -> tuple[str, int, int] | None:
    """``(kind, world_size, rank)`` of a per-rank file name, None for any other name."""
    match = _RANK_FILE.fullmatch(name)
    return (match.group(1), int(match.group(2)), int(match.group(3))) if match else None
