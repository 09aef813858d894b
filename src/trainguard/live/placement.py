"""Which node runs which process of a live run on separate hosts (``trainguard run --launcher hosts``).

Replica group ``g`` starts on host ``g`` of ``--hosts`` (a group's ranks share a node, as HSDP's shard
dimension does), and the hosts after the groups' are spare nodes: the warm spares start there (one
after the other, round robin), or on the groups' nodes when there is none. A rank that dies is
replaced on its group's node while that node lives (the process failed, not the host); a node whose
ranks were found hung (a cut link, a dead host: the launcher cannot tell them apart, and cannot reach
either) is lost, and so is a node whose node command itself failed (it ended before the rank it
started reached the store: an ``ssh`` that could not connect); the lost node's ranks' replacements start
on the first spare node not lost, else on the live node holding the fewest of the run's ranks, and
nowhere when only nodes whose command failed are left. Pure: the launcher keeps the state and asks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...]  # the node of each replica group, then of each warm spare (``LiveRun.nodes``)
    spare_nodes: tuple[str, ...]  # the hosts holding no group at the start (``LiveRun.spare_nodes``)


def place(hosts: list[str], groups: int, spares: int) -> Placement:
    """The start of a run of ``groups`` replica groups and ``spares`` warm spares on ``hosts``; a
    ``ValueError`` when there are fewer hosts than groups."""
    if len(hosts) < groups:
        raise ValueError(f"{len(hosts)} host(s) for {groups} replica groups: one host per replica group, "
                         f"then the spare nodes")
    spare_nodes = tuple(hosts[groups:])
    pool = spare_nodes or tuple(hosts[:groups])
    return Placement(tuple(hosts[:groups]) + tuple(pool[i % len(pool)] for i in range(spares)), spare_nodes)


def replacement_node(home: str, lost: set[str], spare_nodes: tuple[str, ...], running: dict[int, str],
                     unusable: frozenset[str] = frozenset()) -> str | None:
    """Where a cold replacement of a rank whose group lives on ``home`` starts: ``home`` unless it is
    ``lost``, then the first spare node not lost, then the node not lost that runs the fewest ranks
    (``running``: rank -> node); when every node is lost, ``home`` (it waits there for its link) unless
    it is ``unusable`` (lost because its node command failed: nothing starts there), else None."""
    if home not in lost:
        return home
    for node in spare_nodes:
        if node not in lost:
            return node
    load = Counter(node for node in running.values() if node not in lost)
    if load:
        return min(load, key=lambda node: (load[node], node))
    return None if home in unusable else home
