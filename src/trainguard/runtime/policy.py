"""The supervisor's decisions as pure functions: what an incarnation's end means, and what comes next.

No I/O, no clock, no sleeps: the supervisor (``supervisor.py``) feeds in what it observed (the agents'
exit codes, the ranks' heartbeat exit records, the step reached) and carries out the verdict (exclude
a node, wait, restart, stop). Importing this module imports no torch, so the supervisor's exit path
stays fast.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from trainguard.errors import (
    EXIT_CRASH,
    EXIT_DATA_SKIP_ABORT,
    EXIT_FAULTY_HARDWARE,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    EXIT_RESUMABLE_STOP,
    EXIT_STEP_FAILED,
    EXIT_USAGE,
)

# codes a rank gives on purpose, strongest explanation first
MEANINGFUL_EXIT_CODES = (EXIT_USAGE, EXIT_DATA_SKIP_ABORT, EXIT_NO_CHECKPOINT, EXIT_RESUMABLE_STOP,
                         EXIT_FAULTY_HARDWARE, EXIT_STEP_FAILED)
# why a rank's own exit code ends the run, and why a restart would not help
NO_RESTART_REASONS = {
    EXIT_USAGE: ("a configuration or usage error",
                 "a restart would fail the same way; fix it and run the command again"),
    EXIT_DATA_SKIP_ABORT: ("too many skipped steps in a row (consecutive gradient spikes, a rollback that "
                           "gave up, or guards.max_consecutive_skips)",
                           "a restart would resume the same state and data; see docs/guards.md"),
    EXIT_NO_CHECKPOINT: ("no usable checkpoint to resume from", "a restart would find none either"),
    EXIT_RESUMABLE_STOP: ("a stop asked for (SIGTERM/SIGUSR1 or the time limit), the last step saved",
                          "it is resumable: run the same command again to continue"),
    EXIT_STEP_FAILED: ("a live step raised the same way fault_tolerance.max_step_failures times in a row, or no "
                       "checkpoint left that a live restore could load",
                       "a restart would compute or load the same again; fix what its line names"),
}
NEVER_RESTART = (EXIT_OK, *NO_RESTART_REASONS)  # each with its line, so a code never stops a run unexplained


def stop_explanation(exit_code: int, step: int | None, detail: str | None, stop_signal: str | None) -> str | None:
    """The supervisor's one line when a run ends with a code it never restarts (None for 0 and for
    codes it does restart): what stopped the run and why it is not restarted."""
    if exit_code not in NO_RESTART_REASONS:
        return None
    what, why = NO_RESTART_REASONS[exit_code]
    if stop_signal is not None and exit_code == EXIT_RESUMABLE_STOP:
        what = f"received {stop_signal}, the ranks stopped"
    at = f" at step {step}" if step is not None else ""
    by = f"; {detail}" if detail else ""
    return f"stopped{at}: exit {exit_code}, {what}{by}; not restarted: {why}"


def exit_code_of(failure_codes: list[int]) -> int:
    """The code that explains a failed group: a meaningful code if any rank gave one, else crash."""
    for code in MEANINGFUL_EXIT_CODES:
        if code in failure_codes:
            return code
    return EXIT_CRASH


class Outcome(str, enum.Enum):
    """How an incarnation ended (the spelling is what events and summaries show)."""

    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"  # a stop asked for (signal, time limit): exit 16, resumable, not a failure
    FAILED = "failed"
    HANG = "hang"
    NODE_LOST = "node_lost"  # a node's agent stopped answering over the network (link down, host gone)


def classify(agent_codes: list[int], rank_exits: dict[int, int]) -> int:
    """The exit code that explains an incarnation.

    ``agent_codes`` are what the supervisor's children returned (a launcher such as ``torchrun`` turns
    every rank's code into 1, an agent killed by a signal gives a negative code); ``rank_exits`` are
    the codes the ranks recorded in their heartbeats just before exiting, by rank. The ranks' own
    codes explain a failure whatever launcher sat between them and the supervisor.
    """
    failed = [code for code in agent_codes if code != 0]
    if not failed:
        return EXIT_OK
    intended = [code for code in rank_exits.values() if code != 0]
    return exit_code_of(intended + failed)


def outcome_of(exit_code: int) -> Outcome:
    if exit_code == EXIT_OK:
        return Outcome.FINISHED
    if exit_code == EXIT_RESUMABLE_STOP:
        return Outcome.STOPPED
    return Outcome.FAILED


def first_rank_with(code: int, rank_exits: dict[int, int], exit_times: dict[int, float]) -> int | None:
    """The rank that recorded ``code`` first (the one whose decision ended the group), or None."""
    ranks = [rank for rank, recorded in rank_exits.items() if recorded == code]
    return min(ranks, key=lambda rank: (exit_times.get(rank, 0.0), rank)) if ranks else None


def backoff_seconds(base: float, cap: float, failures_without_progress: int) -> float:
    """``base`` after a failure that followed progress, doubling for each failure in a row without."""
    return min(cap, base * 2 ** max(0, failures_without_progress - 1))


class Action(enum.Enum):
    FINISH = "finish"  # pass the exit code on: done, stopped on purpose, or an error a restart cannot fix
    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int
    reason: str = ""
    delay: float = 0.0  # seconds to wait before a restart


@dataclass(frozen=True)
class Ended:
    """What the policy needs to know of an ended incarnation."""

    outcome: Outcome
    exit_code: int
    reached_step: int | None
    failing_rank: int | None = None
    failing_node: str | None = None


class ExclusionReason(enum.Enum):
    """Why a node is excluded, as ``node_excluded`` events spell it (the incarnation's outcome,
    ``failed``, says nothing of it)."""

    FAULTY_HARDWARE = "faulty_hardware"
    NODE_LOST = "node_lost"
    REPEATED_FAILURES = "repeated_failures"


@dataclass(frozen=True)
class Exclusion:
    node: str
    reason: ExclusionReason


@dataclass
class RestartPolicy:
    """Restart budget, crash loop, backoff and node exclusion over the incarnations of one run."""

    max_restarts: int
    crash_loop: int
    backoff: float
    backoff_max: float
    node_failures: int
    several_nodes: bool  # with one node, a repeated death is a crash loop, not a node to exclude
    restarts: int = 0
    failures_without_progress: int = 0
    high_water: int = -1  # the highest step any incarnation completed
    node_deaths: dict[str, int] = field(default_factory=dict)

    def observe(self, ended: Ended, stop_requested: bool) -> Decision | None:
        """Records an ended incarnation; a decision to end the run here, or None to go on failing over."""
        progressed = ended.reached_step is not None and ended.reached_step > self.high_water
        if ended.reached_step is not None:
            self.high_water = max(self.high_water, ended.reached_step)
        if ended.outcome is Outcome.FINISHED or ended.exit_code in NEVER_RESTART or stop_requested:
            return Decision(Action.FINISH, ended.exit_code)
        self.failures_without_progress = 0 if progressed else self.failures_without_progress + 1
        return None

    def node_to_exclude(self, ended: Ended, active_nodes: list[str]) -> Exclusion | None:
        node = ended.failing_node
        if node is None or node not in active_nodes:
            return None
        if ended.exit_code == EXIT_FAULTY_HARDWARE:
            return Exclusion(node, ExclusionReason.FAULTY_HARDWARE)
        if ended.outcome is Outcome.NODE_LOST:
            # not retried: its ranks' peers cannot reach it either
            return Exclusion(node, ExclusionReason.NODE_LOST)
        if not self.several_nodes or ended.failing_rank is None:
            return None
        self.node_deaths[node] = self.node_deaths.get(node, 0) + 1
        if self.node_deaths[node] < self.node_failures:
            return None
        return Exclusion(node, ExclusionReason.REPEATED_FAILURES)

    def replaced_node(self) -> None:
        """A spare took a failed node's slot: a new node deserves a fresh count."""
        self.failures_without_progress = 0

    def next_attempt(self, ended: Ended) -> Decision:
        """After a failure (and any exclusion): restart after a backoff, or give up."""
        code = ended.exit_code if ended.exit_code not in (EXIT_OK, None) else EXIT_CRASH
        if self.restarts >= self.max_restarts:
            return Decision(Action.GIVE_UP, code, f"--max-restarts {self.max_restarts} used up")
        if self.failures_without_progress >= self.crash_loop:
            return Decision(Action.GIVE_UP, code, f"crash loop: {self.failures_without_progress} failures in a row "
                                                  f"without a new step (highest step {self.high_water})")
        self.restarts += 1
        delay = backoff_seconds(self.backoff, self.backoff_max, max(1, self.failures_without_progress))
        return Decision(Action.RESTART, code, ended.outcome.value, delay)
