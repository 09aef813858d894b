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
``stop``) followed by its proof of the run secret (``run_secret.prove_request``: an HMAC over the
request, a time and a nonce); the answer is one JSON line. A request without a valid proof (no proof,
a bad one, a stale one, a replay) is refused, answered ``{"ok": false, "error": "refused: ..."}`` and
logged on the agent's stderr in one line naming its sender (docs/security.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from trainguard.fs.fsio import atomic_write_text
from trainguard.run_secret import RequestCheck, load_secret, prove_request
from trainguard.runtime.heartbeat import ENV_INCARNATION, node_name, read_heartbeats
from trainguard.runtime.nodes import descendants, kill_tree

ENV_AGENT_CONTROL = "TRAINGUARD_AGENT_CONTROL"
ENV_NODE_ADDR = "TRAINGUARD_NODE_ADDR"
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2}
MAX_REQUEST = 1024  # bytes of a request line read at most
MAX_ANSWER = 1 << 16  # bytes of an answer read at most


def node_address() -> str:
    """The address this node's agent and rendezvous use (loopback for simulated nodes)."""
    return os.environ.get(ENV_NODE_ADDR, "127.0.0.1")


class AgentControl:
    """The server, in a daemon thread of the agent process."""

    def __init__(self, run_dir: Path, node: str, incarnation: int | None, secret: bytes):
        self.run_dir = Path(run_dir)
        self.node = node
        self.incarnation = incarnation
        self.requests = RequestCheck(secret)
        self.checking = threading.Lock()  # one request checked at a time: the replay memory is shared
        self.server = socket.create_server((node_address(), 0))

    def start(self, address_file: Path) -> None:
        host, port = self.server.getsockname()[:2]
        address_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(address_file, f"{host}:{port}\n")
        threading.Thread(target=self._serve, name="trainguard-agent-control", daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, peer = self.server.accept()
            # a thread per connection: a client that connects and says nothing must not hold up the
            # supervisor's liveness check (its silence would read as a lost node)
            threading.Thread(target=self._handle, args=(connection, peer), daemon=True).start()

    def _handle(self, connection: socket.socket, peer: tuple) -> None:
        with connection:
            connection.settimeout(5)
            try:
                line = connection.makefile("rb").readline(MAX_REQUEST).decode(errors="replace")
                connection.sendall((json.dumps(self.checked_answer(line, peer)) + "\n").encode())
            except OSError:
                return

    def checked_answer(self, line: str, peer: tuple) -> dict:
        """The answer to a request line from ``peer``: refused (one line on stderr) without a valid proof."""
        with self.checking:
            verdict = self.requests.check(line)
        if verdict.refused is None:
            return self.answer(verdict.words)
        print(f"trainguard agent {self.node}: refused request {' '.join(verdict.words)[:80]!r} from "
              f"{peer[0]}:{peer[1]}: {verdict.refused}", file=sys.stderr, flush=True)
        return {"ok": False, "error": f"refused: {verdict.refused}"}

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
    AgentControl(run_dir, node_name(), int(incarnation) if incarnation else None,
                 load_secret(run_dir)).start(Path(address_file))


def ask(address_file: Path, request: str, secret: bytes, timeout: float = 2.0) -> dict | None:
    """One request to a node's agent, proved with the run's ``secret``; None when it cannot be reached
    (no address yet, no answer). An answer that is not one JSON object is none."""
    try:
        host, _, port = Path(address_file).read_text().strip().rpartition(":")
        with socket.create_connection((host, int(port)), timeout=timeout) as connection:
            connection.sendall(f"{prove_request(secret, request)}\n".encode())
            line = connection.makefile("rb").readline(MAX_ANSWER).decode(errors="replace")
    except (OSError, ValueError):
        return None
    try:
        answer = json.loads(line) if line else None
    except (ValueError, RecursionError):  # garbage, or nesting deep enough to exhaust the parser
        return None
    return answer if isinstance(answer, dict) else None  # what answers there may not be our agent
