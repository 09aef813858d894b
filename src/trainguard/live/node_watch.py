"""Tells a node command's own failure from a rank's death, for the live launcher on other nodes.

A rank (or warm spare) on another node is started behind ``LiveRun.node_command`` (``ssh``, ``ip netns
exec``, ``srun``). When that command cannot run it (``ssh`` exits 255 at once when it cannot connect,
``ip netns exec`` when the namespace does not exist), the launcher saw only a process that ended, and
replaced it on the same node, where it failed again until ``LiveRun.max_replacements``. Here each such
process is known by the count its rank raises once it reaches the store (``quorum.started_key``): read
before the start, unchanged at the end, the process never ran as the rank, and the node is lost
(``live_node_lost``, reason ``node_command_failed``) with the command's exit code and last line of
standard error (``live.node_output``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainguard.live.node_output import NodeOutput
from trainguard.live.signed_store import SignedStore


@dataclass(frozen=True)
class NodeCommandFailed:
    """A node command that ended before the process it started reached the store."""

    node: str
    command: str  # the node command's program (its first word)
    exit_code: int
    error: str  # the last line it wrote to standard error ('' if none)

    def describe(self) -> str:
        return f"{self.command} exited {self.exit_code}: {self.error or 'no message'}"


@dataclass(frozen=True)
class _Started:
    node: str
    command: str
    key: str
    count: int  # the key's count before the start


class NodeWatch:
    def __init__(self, store: SignedStore, output_dir: Path):
        self.store = store
        self.output = NodeOutput(output_dir)
        self.started: dict[int, _Started] = {}  # pid of the node command -> what it started
        self.verdicts: dict[int, NodeCommandFailed | None] = {}  # pid of an ended node command -> ``failure``

    def start(self, node: str, command: list[str], started_key: str,
              popen: Callable[[BinaryIO], subprocess.Popen]) -> subprocess.Popen:
        """``popen(stderr)`` starts ``command`` on ``node``; its rank raises ``started_key`` once it runs."""
        count = self.store.add(started_key, 0)  # before the start: the rank may raise it at once
        proc = self.output.start(node, popen)
        self.started[proc.pid] = _Started(node, command[0], started_key, count)
        self.verdicts.pop(proc.pid, None)  # a pid used again
        return proc

    def failure(self, proc: subprocess.Popen) -> NodeCommandFailed | None:
        """The node command's own failure when ``proc`` (started by ``start``) ended with an error before its
        rank reached the store; None for a rank's death, a process still running or not started here."""
        started = self.started.get(proc.pid)
        code = proc.poll()
        if started is None or code is None:
            return None
        if proc.pid not in self.verdicts:  # judged once, at its end
            ran = code == 0 or self.store.add(started.key, 0) > started.count
            self.verdicts[proc.pid] = None if ran else NodeCommandFailed(started.node, started.command, code,
                                                                         self.output.last_line(proc.pid))
        return self.verdicts[proc.pid]

    def close(self) -> None:
        self.output.close()
