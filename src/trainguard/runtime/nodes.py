"""Nodes: which node holds which slot (node rank), exclusion, spares, and starting one agent per node.

A run needs ``nnodes`` nodes; the pool may hold spares beyond them (reference 002 kept 4 of 52 nodes
in reserve). Slot ``i`` is node rank ``i`` of torch's static rendezvous, so global ranks
``i*nproc .. (i+1)*nproc-1`` always live in slot ``i`` whichever node holds it: a spare that replaces an
excluded node takes over its slot, and the world size and rank layout stay the same.

Two ways to start an agent on a node, the same supervisor drives both:
- ``LocalNodes``: simulated nodes on this machine, one agent process per node, rendezvous on
  127.0.0.1;
- ``SlurmNodes``: real nodes of a Slurm allocation, one ``srun --nodes=1 --nodelist=NODE`` step per
  node, rendezvous on the node holding slot 0.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
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


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the kernel picked, held bound (not listening) with ``SO_REUSEADDR``: while it is
    open no bind without ``SO_REUSEADDR`` and no kernel pick for port 0 gets that port, and torch's TCPStore
    server, which binds with ``SO_REUSEADDR``, can still bind and listen on it. A port bound to 0 and closed
    before its user binds it could be handed to another run on this machine meanwhile."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def agent_env(node: str, node_rank: int, nnodes: int, endpoint: str, extra: dict[str, str]) -> dict[str, str]:
    return {
        "TRAINGUARD_NODE": node,
        ENV_NODE_RANK: str(node_rank),
        ENV_NNODES: str(nnodes),
        ENV_RDZV_ENDPOINT: endpoint,
        ENV_SUPERVISED: "1",
        **extra,
    }


class ForkedAgent:
    """An agent forked from this process (``subprocess.Popen``'s interface, as far as the supervisor uses it)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def _status(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._status(os.WNOHANG)

    def wait(self) -> int:
        return self._status(0)

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, read from /proc (this host only)."""
    stack, found = [pid], []
    while stack:
        current = stack.pop()
        found.append(current)
        stack += _children(current)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILLs a process and all its descendants (an agent and its ranks), leaving the caller alone.

    Agents stay in the supervisor's process group, so that whoever kills the job's group (Ctrl-C, a
    test, Slurm) kills them too; the supervisor therefore kills an agent by walking its tree.
    """
    for _ in range(2):  # a second pass for children forked while the first pass ran
        for target in descendants(pid):
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def fork_agent(run: Callable[[list[str]], int], command: list[str], env: dict[str, str]) -> ForkedAgent:
    """Forks an agent that runs ``run(command)`` in a copy of this process: no new interpreter, no imports."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedAgent(pid)
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(env)
        code = run(command)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class LocalNodes:
    """Simulated nodes: ``node0, node1, ...``, every agent a child process of this machine.

    With ``fork_run`` (``trainguard train``), agents are forked from the supervisor, which has imported
    the trainer once: a restart then pays no interpreter start and no imports. Otherwise each agent
    runs the command as a new process.
    """

    kind = "local"

    def __init__(self, count: int, fork_run: Callable[[list[str]], int] | None = None):
        self.names = [f"node{i}" for i in range(count)]
        self.fork_run = fork_run
        self.rendezvous_port: socket.socket | None = None  # the current incarnation's, held (``reserve_port``)

    def endpoint(self, slot0: str) -> str:
        """The rendezvous endpoint of an incarnation, whose slot-0 agent's TCPStore binds it later: its port held
        reserved until the next incarnation's endpoint (or this process's end), so no other run on this
        machine can take it meanwhile; a new port each time (the previous store's may linger in TIME_WAIT)."""
        if self.rendezvous_port is not None:
            self.rendezvous_port.close()
        self.rendezvous_port = reserve_port()
        return f"127.0.0.1:{self.rendezvous_port.getsockname()[1]}"

    def command(self, node: str, command: list[str]) -> list[str]:
        return list(command)

    def start(self, node: str, command: list[str], env: dict[str, str]):
        if self.fork_run is not None:
            return fork_agent(self.fork_run, command, env)
        return subprocess.Popen(self.command(node, command), env={**os.environ, **env})

    def signal_ranks(self, node: str, agent, ranks: dict[int, int], sig: signal.Signals) -> list[int]:
        """Signals the ranks (``pid -> rank``, from the node's heartbeats) that run under this node's
        agent (a pid read from a heartbeat is only trusted inside the agent's own process tree);
        returns the ranks signalled."""
        if not ranks:
            return []
        below = set(descendants(agent.pid)) - {agent.pid}
        sent = []
        for pid, rank in ranks.items():
            if pid in below:
                try:
                    os.kill(pid, sig)
                    sent.append(rank)
                except (ProcessLookupError, PermissionError):
                    pass
        return sent

    def answers(self, node: str) -> bool | None:
        """Whether the node's agent answers over the network: never asked of processes of this machine."""
        return None

    def stop(self, node: str, agent) -> None:
        kill_tree(agent.pid)


class SlurmNodes:
    """The nodes of the Slurm allocation (``SLURM_JOB_NODELIST``), one ``srun`` step per agent."""

    kind = "slurm"

    def __init__(self, names: list[str], base_port: int = 29500, job_id: str | None = None):
        self.names = names
        self.base_port = base_port
        self.job_id = job_id or os.environ.get("SLURM_JOB_ID", "")
        self._starts = 0
        self._step_names: dict[str, str] = {}  # node -> the name of the job step its agent runs as
        self._signalled: set[tuple[str, signal.Signals]] = set()  # (step name, signal) scancel delivered

    @classmethod
    def from_environment(cls) -> "SlurmNodes":
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            from trainguard.errors import ConfigError

            raise ConfigError("--launcher slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm allocation)")
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return cls(out.stdout.split())

    def endpoint(self, slot0: str) -> str:
        # a new port per incarnation (the previous store's socket may linger in TIME_WAIT), and another
        # range per job (two jobs may share a node)
        self._starts += 1
        offset = (int(self.job_id or 0) * 16 + self._starts) % 2000
        return f"{self.address(slot0)}:{self.base_port + offset}"

    @staticmethod
    def address(node: str) -> str:
        """The node's address as Slurm knows it (``NodeAddr``, which defaults to the node's name)."""
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        return fields.get("NodeAddr") or node

    def command(self, node: str, command: list[str], step_name: str = "trainguard") -> list[str]:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=1",
                f"--job-name={step_name}", "--output=%x-%j-%N.out", "--open-mode=append", *command]

    def start(self, node: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        # the step's name finds its id later: signals and the end of a step go through Slurm
        step_name = f"trainguard-{self._starts}-{node}"
        self._step_names[node] = step_name
        # srun passes the environment on to the task (--export=ALL is its default)
        return subprocess.Popen(self.command(node, command, step_name), env={**os.environ, **env})

    def step_id(self, node: str) -> str | None:
        """``JOB.STEP`` of the step running this node's agent, or None once it is gone."""
        name = self._step_names.get(node)
        out = subprocess.run(["squeue", "--steps", "--noheader", "--jobs", self.job_id, "--format", "%i %j"],
                             capture_output=True, text=True)
        for line in out.stdout.splitlines():
            step, _, step_name = line.strip().partition(" ")
            if step_name.strip() == name:
                return step
        return None

    def signal_ranks(self, node: str, agent, ranks: dict[int, int], sig: signal.Signals) -> list[int]:
        """Has Slurm deliver ``sig`` to every process of the node's job step (the agent ignores it,
        the ranks act on it); no pid of another host is ever used here. Once per step and signal: that
        delivery reached the step's ranks that had no heartbeat yet too, and a second one would be a
        second stop (a rank then exits at once)."""
        if not ranks:
            return []
        if (self._step_names.get(node), sig) in self._signalled:
            return sorted(ranks.values())
        step = self.step_id(node)
        if step is None:
            return []
        done = subprocess.run(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step], capture_output=True)
        if done.returncode != 0:
            return []
        self._signalled.add((self._step_names.get(node), sig))
        return sorted(ranks.values())

    def answers(self, node: str) -> bool | None:
        """Not asked: a node that stops answering is Slurm's to notice (``SlurmdTimeout``)."""
        return None

    def stop(self, node: str, agent) -> None:
        """Ends the node's job step itself (killing only the local ``srun`` client would leave it running
        and block the next step), then the client."""
        step = self.step_id(node)
        if step is not None:
            subprocess.run(["scancel", "--signal=KILL", step], capture_output=True)
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(agent.pid)


def render(command: list[str]) -> str:
    return shlex.join(command)
