"""Which files move where to make a local step whole again (pure; shared by online recovery and
offline repair).

A rank's model file can come from any member of its model replica group, its optimizer file from
any member of its optimizer replica group, and its extra state (unique to it) from the rank that keeps
a copy of it: its *buddy*, the next member of its full replica group (rotating, so in HSDP the copy
lives on another replica, which is another node when replicas span nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.checkpoint.local.paths import rank_file_names, replica_extra_name
from trainguard.checkpoint.local.reader import StepHoldings
from trainguard.checkpoint.manifest import FileEntry
from trainguard.topology.replica_groups import ReplicaGroups


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    src_path: str
    """Relative to the source rank's step directory."""
    dst_path: str
    """Relative to the destination rank's step directory."""
    entry: FileEntry
    """Size and checksum the bytes must have (from the source's manifest)."""


@dataclass(frozen=True)
class StepPlan:
    step: int
    transfers: tuple[Transfer, ...]
    lost: tuple[tuple[int, str], ...]
    """``(rank, kind)`` that no intact replica can supply."""

    @property
    def recoverable(self) -> bool:
        return not self.lost

    @property
    def lost_ranks(self) -> list[int]:
        return sorted({rank for rank, _ in self.lost})

    @property
    def bytes(self) -> int:
        return sum(t.entry.size for t in self.transfers)


def buddy_of(groups: ReplicaGroups, rank: int) -> int | None:
    """The rank that keeps a copy of ``rank``'s extra state; None without a replica."""
    group = groups.full_replicas(rank)
    if len(group) < 2:
        return None
    return group[(group.index(rank) + 1) % len(group)]


def plan_step(step: int, groups: ReplicaGroups, holdings: dict[int, dict[int, StepHoldings]]) -> StepPlan:
    """The transfers that restore every rank's files of ``step``; ``holdings`` is ``rank -> step ->``
    what that rank holds intact (ranks or steps absent hold nothing)."""
    world_size = groups.world_size
    held = {rank: holdings.get(rank, {}).get(step, StepHoldings()) for rank in range(world_size)}
    transfers: list[Transfer] = []
    lost: list[tuple[int, str]] = []
    for rank in range(world_size):
        names = rank_file_names(world_size, rank)
        sources = {"model": groups.model_replicas(rank), "optim": groups.optim_replicas(rank)}
        for kind in ("model", "optim"):
            if kind in held[rank].own:
                continue
            donor = next((r for r in sources[kind] if kind in held[r].own), None)
            if donor is None:
                lost.append((rank, kind))
                continue
            transfers.append(Transfer(donor, rank, rank_file_names(world_size, donor)[kind], names[kind],
                                      held[donor].own[kind]))
        if "extra" not in held[rank].own:
            holder = next((r for r in range(world_size) if rank in held[r].replica_extras), None)
            if holder is None:
                lost.append((rank, "extra"))
            else:
                transfers.append(Transfer(holder, rank, replica_extra_name(world_size, rank), names["extra"],
                                          held[holder].replica_extras[rank]))
        for owner in range(world_size):
            # the copies this rank keeps for others: restored from their owners where those are intact
            if buddy_of(groups, owner) == rank and owner not in held[rank].replica_extras and "extra" in held[owner].own:
                transfers.append(Transfer(owner, rank, rank_file_names(world_size, owner)["extra"],
                                          replica_extra_name(world_size, owner), held[owner].own["extra"]))
    return StepPlan(step, tuple(transfers), tuple(lost))

