"""A live run that cannot start: every rank's process ended before the run committed its first step.

Live recovery replaces a dead rank while the others keep stepping, but when every rank has died before
the first step (a module missing from the environment, a script that crashes at its start, a node's
processes all killed, ranks that exit before they train), a replacement would run the same program on
the same nodes and end the same way. As the restart supervisor's crash loop (`--crash-loop`: failed
incarnations in a row that completed no new step), such a start is a deterministic failure: the launcher
ends the run at once, exit 1, with one line naming each rank's exit code, its node and its last line of
standard error where the launcher relays it (``live.node_output``), instead of replacing ranks until
``LiveRun.max_replacements``. A rank whose node command itself failed (``live.node_watch``) is the node's
failure, judged by the lost-node path (``no node left``), not counted here.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EarlyExit:
    """A rank's process that ended before the run's first committed step."""

    rank: int
    code: int
    node: str | None  # None: a process on the launcher's machine
    error: str  # its last line of standard error ('' where the launcher does not relay it)

    def describe(self) -> str:
        where = f" on node {self.node}" if self.node is not None else ""
        how = f"exited {self.code}" if self.code >= 0 else f"was killed by {_signal_name(-self.code)}"
        return f"rank {self.rank} {how}{where}" + (f": {self.error}" if self.error else "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def cannot_start(world: int, early: Mapping[int, EarlyExit]) -> bool:
    """Every rank of the run has had a process end before the run's first committed step."""
    return set(early) >= set(range(world))


def start_failure_line(early: Mapping[int, EarlyExit]) -> str:
    return ("live run: every rank ended before the first step (a failure at start, not retried): "
            + "; ".join(early[rank].describe() for rank in sorted(early)))
