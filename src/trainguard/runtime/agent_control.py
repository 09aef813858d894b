"""A node's agent answers the supervisor over the network: signals for its ranks, stop, and "are you there".

On nodes that are other hosts (``--launcher hosts``), a pid in a heartbeat means nothing to the
supervisor: it names a process of another machine (or of another pid namespace). So the supervisor
never signals a pid; it asks the node's agent, which signals its own ranks (the pids its node's
heartbeats name, and only those below the agent in its own process tree). The same connection is the
node's liveness check: an agent that does not answer for ``--node-timeout`` seconds means the node is
gone (its link is down, or the host died), which no heartbeat file on a shared file system can tell.

The agent listens on its node's address (``TRAINGUARD_NODE_ADDR``) at a port of its choosing and writes
``address:port`` to the file named by ``TRAINGUARD_AGENT_CONTROL`` (on the run's shared file system),
where the supervisor reads it. A request is one line (``ping``, ``signal USR1``, ``signal USR2``,
``stop``); the answer is one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

from trainguard.fs.fsio import atomic_write_text
from trainguard.runtime.heartbeat import ENV_INCARNATION, node_name, read_heartbeats
from trainguard.runtime.nodes import descendants, kill_tree

ENV_AGENT_CONTROL = "TRAINGUARD_AGENT_CONTROL"
ENV_NODE_ADDR = "TRAINGUARD_NODE_ADDR"
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2}


def node_address() -> str:
    """The address this node's agent and rendezvous use (loopback for simulated nodes)."""
    return os.environ.get(ENV_NODE_ADDR, "127.0.0.1")


class AgentControl:
    """The server, in a daemon thread of the agent process."""

    def __init__(self, run_dir: Path, node: str, incarnation: int | None):
        self.run_dir = Path(run_dir)
        self.node = node
        self.incarnation = incarnation
        self.server = socket.create_server((node_address(), 0))

    def start(self, address_file: Path) -> None:
        host, port = self.server.getsockname()[:2]
        address_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(address_file, f"{host}:{port}\n")
        threading.Thread(target=self._serve, name="trainguard-agent-control", daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, _ = self.server.accept()
            with connection:
                connection.settimeout(5)
                try:
                    request = connection.makefile("r").readline().split()
                    connection.sendall((json.dumps(self.answer(request)) + "\n").encode())
                except OSError:
                    continue

    def _my_ranks(self) -> dict[int, int]:
        """pid -> rank of this node's ranks in this incarnation that run below this agent."""
        below = set(descendants(os.getpid())) - {os.getpid()}
        return {beat.pid: rank for rank, beat in read_heartbeats(self.run_dir).items()
                if beat.node == self.node and beat.incarnation == self.incarnation and beat.pid in below}

    def answer(self, request: list[str]) -> dict:
        if request == ["ping"]:
            return {"ok": True, "node": self.node}
        if len(request) == 2 and request[0] == "signal" and request[1] in SIGNALS:
            reached = []
            for pid, rank in self._my_ranks().items():
                try:
                    os.kill(pid, SIGNALS[request[1]])
                    reached.append(rank)
                except ProcessLookupError:
                    continue
            return {"ok": True, "ranks": sorted(reached)}
        if request == ["stop"]:
            # the ranks and everything below them, then this agent (pid 1 of a pid namespace cannot
            # signal itself to death, so it exits)
            for child in set(descendants(os.getpid())) - {os.getpid()}:
                kill_tree(child)
            os._exit(137)
        return {"ok": False, "error": f"unknown request {' '.join(request)!r}"}


def serve_from_environment(run_dir: Path) -> None:
    """Starts the control server when the supervisor asked for one (``TRAINGUARD_AGENT_CONTROL``)."""
    address_file = os.environ.get(ENV_AGENT_CONTROL)
    if not address_file:
        return
    incarnation = os.environ.get(ENV_INCARNATION)
    AgentControl(run_dir, node_name(), int(incarnation) if incarnation else None).start(Path(address_file))


def ask(address_file: Path, request: str, timeout: float = 2.0) -> dict | None:
    """One request to a node's agent; None when it cannot be reached (no address yet, no answer)."""
    try:
        host, _, port = Path(address_file).read_text().strip().rpartition(":")
        with socket.create_connection((host, int(port)), timeout=timeout) as connection:
            connection.sendall(f"{request}\n".encode())
            line = connection.makefile("r").readline()
    except (OSError, ValueError):
        return None
    try:
        return json.loads(line) if line else None
    except ValueError:
        return None
