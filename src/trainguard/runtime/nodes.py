"""Nodes: which node holds which slot (node rank), exclusion, spares, and starting one agent per node.

A run needs ``nnodes`` nodes; the pool may hold spares beyond them (reference 002 kept 4 of 52 nodes
in reserve). Slot ``i`` is node rank ``i`` of torch's static rendezvous, so global ranks
``i*nproc .. (i+1)*nproc-1`` always live in slot ``i`` whichever node holds it: a spare that replaces an
excluded node takes over its slot, and the world size and rank layout stay the same.

Two ways to start an agent on a node, the same supervisor drives both:
- ``LocalNodes``: simulated nodes on this machine, one agent process per node (its own process
  group), rendezvous on 127.0.0.1;
- ``SlurmNodes``: real nodes of a Slurm allocation, one ``srun --nodes=1 --nodelist=NODE`` step per
  node, rendezvous on the node holding slot 0.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from dataclasses import dataclass, field

ENV_NNODES = "TRAINGUARD_NNODES"
ENV_NODE_RANK = "TRAINGUARD_NODE_RANK"
ENV_RDZV_ENDPOINT = "TRAINGUARD_RDZV_ENDPOINT"
ENV_SUPERVISED = "TRAINGUARD_SUPERVISED"
ENV_AGENT_REPORT = "TRAINGUARD_AGENT_REPORT"


@dataclass
class NodePool:
    """Slot assignment over a list of node names: the first ``nnodes`` not excluded are active."""

    names: list[str]
    nnodes: int
    excluded: dict[str, str] = field(default_factory=dict)  # node -> reason
    slots: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.slots:
            usable = [name for name in self.names if name not in self.excluded]
            self.slots = usable[: self.nnodes]

    @property
    def complete(self) -> bool:
        return len(self.slots) == self.nnodes

    @property
    def spares(self) -> list[str]:
        return [name for name in self.names if name not in self.excluded and name not in self.slots]

    def exclude(self, node: str, reason: str) -> str | None:
        """Takes ``node`` out for good; returns the spare now holding its slot, or None if none is left."""
        self.excluded[node] = reason
        if node not in self.slots:
            return None
        slot = self.slots.index(node)
        spares = self.spares
        if not spares:
            self.slots.remove(node)
            return None
        self.slots[slot] = spares[0]
        return spares[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_env(node: str, node_rank: int, nnodes: int, endpoint: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "TRAINGUARD_NODE": node,
        ENV_NODE_RANK: str(node_rank),
        ENV_NNODES: str(nnodes),
        ENV_RDZV_ENDPOINT: endpoint,
        ENV_SUPERVISED: "1",
        **extra,
    }


class LocalNodes:
    """Simulated nodes: ``node0, node1, ...``, every agent a child process of this machine."""

    kind = "local"

    def __init__(self, count: int):
        self.names = [f"node{i}" for i in range(count)]

    def endpoint(self, slot0: str) -> str:
        return f"127.0.0.1:{free_port()}"

    def command(self, node: str, command: list[str]) -> list[str]:
        return list(command)

    def start(self, node: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, command), env={**os.environ, **env}, start_new_session=True)


class SlurmNodes:
    """The nodes of the Slurm allocation (``SLURM_JOB_NODELIST``), one ``srun`` step per agent."""

    kind = "slurm"

    def __init__(self, names: list[str], base_port: int = 29500):
        self.names = names
        self.base_port = base_port
        self._starts = 0

    @classmethod
    def from_environment(cls) -> "SlurmNodes":
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            from trainguard.errors import ConfigError

            raise ConfigError("--launcher slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm allocation)")
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return cls(out.stdout.split())

    def endpoint(self, slot0: str) -> str:
        # a new port per incarnation: the previous store's socket may linger in TIME_WAIT
        self._starts += 1
        return f"{slot0}:{self.base_port + self._starts % 1000}"

    def command(self, node: str, command: list[str]) -> list[str]:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=1",
                "--output=%x-%j-%N.out", "--open-mode=append", *command]

    def start(self, node: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        # srun passes the environment on to the task (--export=ALL is its default)
        return subprocess.Popen(self.command(node, command), env={**os.environ, **env}, start_new_session=True)


def render(command: list[str]) -> str:
    return shlex.join(command)
