"""Separate hosts on this machine for the tests: each node a network namespace of its own.

A switch namespace holds a bridge; every node namespace (``head`` for the supervisor, ``n1 n2 n3`` for
the agents and ranks) is joined to it by a veth pair whose inner end is ``tg0`` with an address in
``10.231.0.0/24``. The pairs are made inside the switch namespace, so no interface, address or route
of this machine is touched; deleting the namespaces deletes everything.

A node's programs also run in a pid, UTS and mount namespace of their own (``unshare``, see
``node_command``): a heartbeat's pid means nothing outside its node, the host name is the node's name,
and ``LOCAL`` is the node's own disk (a directory of its own bind-mounted there), so a spare starts
with an empty local checkpoint directory, as a new machine would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from helpers.processes import alive

SUBNET = "10.231.0"
NODES = ("n1", "n2", "n3")
HEAD = "head"
INTERFACE = "tg0"
PREFIX = "tgnet"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@dataclass
class NetnsCluster:
    root: Path
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    made: list[str] = field(default_factory=list)

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def address(self, node: str) -> str:
        return f"{SUBNET}.{254 if node == HEAD else NODES.index(node) + 1}"

    @property
    def local(self) -> Path:
        """The path where every node sees its own disk."""
        return self.root / "local"

    def disk(self, node: str) -> Path:
        return self.root / "disks" / node

    # ---------------------------------------------------------------------------------- set up
    def start(self) -> None:
        remove_leftovers()
        switch = self.ns("switch")
        self._add(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        self.local.mkdir(parents=True, exist_ok=True)
        for i, node in enumerate((HEAD, *NODES)):
            name = self.ns(node)
            self._add(name)
            ip("-n", switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", INTERFACE, "netns", name)
            ip("-n", switch, "link", "set", f"v{i}", "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", INTERFACE)
            ip("-n", name, "link", "set", INTERFACE, "up")
            ip("-n", name, "link", "set", "lo", "up")
            if node != HEAD:
                self.disk(node).mkdir(parents=True, exist_ok=True)

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)

    # ------------------------------------------------------------------------------------- use
    def hosts(self) -> str:
        return ",".join(f"{node}={self.address(node)}" for node in NODES)

    def node_command(self) -> str:
        """``--node-command``: into the node's network namespace, then pid, UTS and mount namespaces of
        its own with the node's name and its own disk at ``local``."""
        enter = 'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec "$@"'
        return (f"ip netns exec {self.prefix}-{{node}} unshare --pid --fork --mount-proc --uts --mount -- "
                f"sh -c '{enter}' {{node}} {self.root / 'disks'}/{{node}} {self.local}")

    def on_head(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(HEAD), *command]

    def run_on_head(self, command: list[str], env: dict[str, str], output_path: Path,
                    timeout: float = 300) -> tuple[int, str]:
        """``command`` in the head namespace, in a session of its own, its output to ``output_path`` (a
        file: a process on a node, a stale rank behind a cut link, may hold a pipe open after the command
        ends); its exit code and output. Past ``timeout`` its session is SIGKILLed and the output raised."""
        with open(output_path, "w") as output:
            proc = subprocess.Popen(self.on_head(command), env=env, stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(output_path.read_text()[-4000:]) from None
        return code, output_path.read_text()

    def cut_link(self, node: str) -> None:
        """The node's network goes away (its processes keep running, unreachable)."""
        ip("-n", self.ns(node), "link", "set", INTERFACE, "down")

    def restore_link(self, node: str) -> None:
        """The node's network comes back (its address and route return with the link)."""
        ip("-n", self.ns(node), "link", "set", INTERFACE, "up")

    def pids_of(self, node: str) -> set[int]:
        """The processes (host pids) running in the node's network namespace."""
        return {int(pid) for pid in ip("netns", "pids", self.ns(node), check=False).stdout.split()}

    # -------------------------------------------------------------------------------- tear down
    def stop(self) -> None:
        for name in reversed(self.made):
            kill_namespace(name)
        self.made.clear()


def kill_namespace(name: str) -> None:
    """SIGKILLs what still runs in the namespace (processes the tests started), then deletes it."""
    for _ in range(3):
        pids = [int(pid) for pid in ip("netns", "pids", name, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    ip("netns", "del", name, check=False)


def remove_leftovers() -> None:
    """Namespaces an earlier, aborted test session made (its pid is in their name) and left behind."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not alive(int(owner)):
            kill_namespace(name)
