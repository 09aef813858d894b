"""Nodes that are other hosts, reached by a command that runs a program there (``--launcher hosts``).

``--hosts n1=10.0.0.1,n2=10.0.0.2,...`` names the nodes and their addresses; ``--node-command`` is
the command that runs a program on one of them, ``{node}`` and ``{address}`` filled in (the tests use
``ip netns exec ...``: each node a network namespace of its own). The agent's environment goes on the
command line (``env K=V ... COMMAND``), so it crosses whatever the command crosses.

Everything else crosses the network: the static rendezvous on slot 0's address, the ranks' gloo
connections, and the supervisor's requests to each node's agent (``agent_control``): signals and
stack-dump requests, stop, and the liveness check that finds a node whose link is down.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from trainguard.errors import ConfigError
from trainguard.runtime.agent_control import ENV_AGENT_CONTROL, ENV_NODE_ADDR, ask
from trainguard.runtime.nodes import ENV_AGENT_REPORT, kill_tree

STOP_WAIT = 5.0  # seconds a stopped agent's command gets to exit before it is killed here


def parse_hosts(text: str) -> dict[str, str]:
    """``NAME=ADDRESS,...`` -> {name: address}, in order; one clear error for anything else."""
    hosts: dict[str, str] = {}
    for item in text.split(","):
        name, sep, address = item.strip().partition("=")
        if not sep or not name or not address or name in hosts:
            raise ConfigError(f"--hosts {text!r}: expected NAME=ADDRESS,... with distinct names, got {item!r}")
        hosts[name] = address
    return hosts


SHELL_NODE_COMMANDS = ("ssh",)
"""Node commands that join their arguments with spaces into one line for a shell on the node: what runs
there is given to them as one word, quoted for that shell (``shlex.join``), so that a word with a space
or a quote (a ``--set`` item in ``TRAINGUARD_SET``) arrives whole."""


def on_node(template: list[str], node: str, address: str, command: list[str], env: dict[str, str]) -> list[str]:
    """``command`` run on ``node`` through the node command's words (``template``, {node} and {address}
    filled in), its environment on the command line (``env K=V ...``) so that it crosses whatever the
    node command crosses (``ssh`` does not pass the caller's environment on); quoted for the node's
    shell when the node command is one of ``SHELL_NODE_COMMANDS``."""
    prefix = [part.format(node=node, address=address) for part in template]
    remote = ["env", *(f"{key}={value}" for key, value in env.items()), *command]
    if prefix and Path(prefix[0]).name in SHELL_NODE_COMMANDS:
        return [*prefix, shlex.join(remote)]
    return [*prefix, *remote]


def address_toward(address: str) -> str:
    """This machine's address on the network that reaches ``address`` (the source address the kernel's
    route to it picks): where a listener the nodes must reach binds. A UDP socket's connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as error:
            raise ConfigError(f"--hosts: no route to node address {address!r} from this machine ({error})") from None
        return probe.getsockname()[0]


class HostNodes:
    """One agent per host, started by ``node_command``; signals and liveness through the agent."""

    kind = "hosts"

    def __init__(self, addresses: dict[str, str], node_command: str, base_port: int = 29400):
        self.addresses = addresses
        self.names = list(addresses)
        self.template = shlex.split(node_command)
        if not self.template or shutil.which(self.template[0]) is None:
            raise ConfigError(f"--node-command {node_command!r}: command not found: {self.template[:1]}")
        self.base_port = base_port
        self._starts = 0
        self._control: dict[str, Path] = {}  # node -> the file its agent writes its control address to
        self._signalled: set[tuple[Path, signal.Signals]] = set()  # (agent's control file, signal) delivered
        # the run secret that proves this supervisor to the agents (set by the supervisor, which creates it at launch)
        self.secret: bytes | None = None
        for part in self.template:
            try:
                part.format(node="", address="")
            except (KeyError, IndexError, ValueError):
                raise ConfigError(f"--node-command {node_command!r}: only {{node}} and {{address}} may be "
                                  f"used in braces") from None

    def _secret(self) -> bytes:
        if self.secret is None:
            raise RuntimeError("HostNodes: no run secret to prove requests to the agents with (the supervisor sets it)")
        return self.secret

    def endpoint(self, slot0: str) -> str:
        # a new port per incarnation: the previous rendezvous store's socket may linger in TIME_WAIT
        self._starts += 1
        return f"{self.addresses[slot0]}:{self.base_port + self._starts % 500}"

    def command(self, node: str, command: list[str], env: dict[str, str]) -> list[str]:
        return on_node(self.template, node, self.addresses[node], command, env)

    def start(self, node: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        control = Path(env[ENV_AGENT_REPORT]).with_suffix(".control")
        self._control[node] = control
        env = {**env, ENV_NODE_ADDR: self.addresses[node], ENV_AGENT_CONTROL: str(control)}
        return subprocess.Popen(self.command(node, command, env))

    def signal_ranks(self, node: str, agent, ranks: dict[int, int], sig: signal.Signals) -> list[int]:
        """Asks the node's agent to signal its own ranks (it reads their pids on its host); the
        supervisor's ``ranks`` (pids of another host) are not used. Returns the ranks reached. Once per
        agent and signal, from the first request that reached a rank: the agent signals
        every rank of its node that has a heartbeat, and a second delivery would be a second stop (a rank
        then exits at once); a rank of that node that beats only later is not reached (the request names
        no ranks)."""
        if (self._control[node], sig) in self._signalled:
            return []
        answer = ask(self._control[node], f"signal {sig.name.removeprefix('SIG')}", self._secret())
        ranks = answer.get("ranks") if answer else None
        reached = [rank for rank in ranks if type(rank) is int] if isinstance(ranks, list) else []
        if reached:
            self._signalled.add((self._control[node], sig))
        return reached

    def answers(self, node: str) -> bool | None:
        """True when the node's agent answered, False when it did not, None before it said where it listens."""
        control = self._control.get(node)
        if control is None or not control.exists():
            return None
        return ask(control, "ping", self._secret()) is not None

    def stop(self, node: str, agent) -> None:
        """Asks the agent to end its ranks and itself, then ends the command that started it here (for
        a node that does not answer, only that is possible)."""
        reachable = self.answers(node)
        if reachable:
            ask(self._control[node], "stop", self._secret())
            deadline = time.time() + STOP_WAIT
            while agent.poll() is None and time.time() < deadline:
                time.sleep(0.05)
        if agent.poll() is None:
            kill_tree(agent.pid)

