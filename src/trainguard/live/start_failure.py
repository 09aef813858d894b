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

One rank can also fail at every start while the others train (its script raises before its first step
on each start: a file missing on its node, a dependency broken there). Its replacements would fail the
same way until ``max_replacements`` and then end a run that was training well. ``StartFailures`` counts,
for each rank, its processes that ended in a row before they committed a step since their start
(``fault_tolerance.max_start_failures``, 3). At the limit the launcher moves the rank off its node once,
when a spare node is left (the node is lost: ``live_node_lost``, reason ``start_failed``), and otherwise
gives the rank up: it is not started again and the run goes on degraded, the survivors computing its
replica group's share of every step (the result unchanged, the steps slower), with one line on standard
error and the event ``live_rank_given_up``. A weeks-long run keeps training through the night rather than
end at a fault an operator fixes in the morning; the line says what to fix, and the run's next start
(``--resume auto``) starts every rank again.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field


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


@dataclass
class StartFailures:
    """Each rank's processes that ended in a row before they committed a step since their start."""

    limit: int  # fault_tolerance.max_start_failures
    in_a_row: dict[int, int] = field(default_factory=dict)

    def ended(self, rank: int, stepped: bool) -> bool:
        """A process of ``rank`` ended (``stepped``: after it committed a step); whether its starts have now
        failed ``limit`` times in a row."""
        self.in_a_row[rank] = 0 if stepped else self.in_a_row.get(rank, 0) + 1
        return self.in_a_row[rank] >= self.limit

    def moved(self, rank: int) -> None:
        """``rank`` starts on another node: its count starts again there."""
        self.in_a_row.pop(rank, None)


def given_up_line(ended: EarlyExit, failures: int) -> str:
    return (f"trainguard: live run: rank {ended.rank} failed at start {failures} times in a row "
            f"(fault_tolerance.max_start_failures), last: {ended.describe()}; not started again: the run goes on "
            f"without its replica group until its next start")
