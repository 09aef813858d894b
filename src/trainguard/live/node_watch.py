"""Tells a node command's own failure from a rank's death, for the live launcher on other nodes.

A rank (or warm spare) on another node is started behind ``LiveRun.node_command`` (``ssh``, ``ip netns
exec``, ``srun``). When that command cannot run it (``ssh`` exits 255 at once when it cannot connect,
``ip netns exec`` when the namespace does not exist), the launcher saw only a process that ended, and
replaced it on the same node, where it failed again until ``LiveRun.max_replacements``. Here each such
process is known by the count its rank raises once it reaches the store (``quorum.started_key``): read
before the start, unchanged at the end, the process never ran as the rank, and the node is lost
(``live_node_lost``, reason ``node_command_failed``) with the command's exit code and last line of
standard error (``live.node_output``).

A node command can also end after its rank reached the store: the rank died (``ip netns exec`` and
``srun`` end with the rank's own code; ``ssh`` relays it, or exits ``NODE_COMMAND_ERROR_EXIT`` when the rank
was killed by a signal) or the command itself dropped (``ssh`` exits ``NODE_COMMAND_ERROR_EXIT`` when its
connection is lost) while the rank runs on. Only that exit code is ambiguous, and the rank's heartbeat
(``quorum.beat_key``) tells the two apart: moved within ``DROP_GRACE_S`` of the command's end, the rank is
alive and only its node command was lost (``dropped``); still, it is a death. Any other code is the rank's
death at once.
"""

from __future__ import annotations

import subprocess
import time
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


# ssh's own failure (a connection that cannot be made or was lost), and what ``ip netns exec`` exits with when
# it cannot enter the namespace; ssh also exits with it when the remote process was killed by a signal
NODE_COMMAND_ERROR_EXIT = 255
# how long the rank of a node command that exited NODE_COMMAND_ERROR_EXIT has to show a heartbeat: a rank
# beats at least this often while it computes (between micro-batches) and while it waits
DROP_GRACE_S = 1.0


@dataclass(frozen=True)
class _Started:
    node: str
    command: str
    key: str
    count: int  # the key's count before the start
    beat_key: str | None  # its rank's heartbeat counter (None: a spare, judged by ``failure`` alone)


@dataclass(frozen=True)
class _Ended:
    beats: int  # the rank's heartbeat count when its command's end was first seen
    at: float  # time.monotonic() then


class NodeWatch:
    def __init__(self, store: SignedStore, output_dir: Path):
        self.store = store
        self.output = NodeOutput(output_dir)
        self.started: dict[int, _Started] = {}  # pid of the node command -> what it started
        self.verdicts: dict[int, NodeCommandFailed | None] = {}  # pid of an ended node command -> ``failure``
        self.ended: dict[int, _Ended] = {}  # pid of a node command that ended NODE_COMMAND_ERROR_EXIT -> then

    def start(self, node: str, command: list[str], started_key: str,
              popen: Callable[[BinaryIO], subprocess.Popen], beat_key: str | None = None) -> subprocess.Popen:
        """``popen(stderr)`` starts ``command`` on ``node``; its rank raises ``started_key`` once it runs, and
        ``beat_key`` while it lives (a rank's, for ``dropped``)."""
        count = self.store.add(started_key, 0)  # before the start: the rank may raise it at once
        proc = self.output.start(node, popen)
        self.started[proc.pid] = _Started(node, command[0], started_key, count, beat_key)
        self.verdicts.pop(proc.pid, None)  # a pid used again
        self.ended.pop(proc.pid, None)
        return proc

    def dropped(self, proc: subprocess.Popen) -> bool | None:
        """For a rank's node command that ended after the rank reached the store (``failure`` is None): True
        when the command exited ``NODE_COMMAND_ERROR_EXIT`` and the rank's heartbeat moved since (the command
        dropped, the rank runs on), False for the rank's death (another code, or no beat within
        ``DROP_GRACE_S``), None while the grace runs."""
        started = self.started.get(proc.pid)
        if started is None or started.beat_key is None or proc.poll() != NODE_COMMAND_ERROR_EXIT:
            return False
        beats = self.store.add(started.beat_key, 0)
        ended = self.ended.setdefault(proc.pid, _Ended(beats, time.monotonic()))
        if beats != ended.beats:
            return True
        return False if time.monotonic() - ended.at > DROP_GRACE_S else None

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
