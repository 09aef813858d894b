"""The supervisor: runs a training command as incarnations, one agent per node, until it finishes.

An incarnation starts one agent per active node slot and watches them: their exit codes, the ranks'
heartbeats (``RUN_DIR/heartbeats/``), the agents' failure reports and ``faults/faulty_ranks.json``.
What ends it decides what happens next:

- every agent exits 0: done (exit 0). Exit 2, 3 or 4 (bad config, data-skip abort, no checkpoint)
  and 16 (a stop asked for by a signal or the time limit) are passed on, never restarted;
- 17 (faulty hardware), or a node whose ranks died ``node_failures`` times: that node is excluded
  (``RUN_DIR/nodes/excluded.json``) and a spare takes its slot, or, without a spare, the run stops;
- a crash, a killed rank, or a hang (no heartbeat progress for the hang timeout: stacks dumped into
  ``RUN_DIR/hangs/``, the whole group killed): restart after a backoff, resuming from the newest
  recoverable checkpoint (the trainer's ``checkpoint.resume: auto``), unless ``max_restarts`` are used
  up or the run is in a crash loop (``crash_loop`` failures in a row without a new step).

Every incarnation is an event; a restart that completes a step records the time it took to recover.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import atomic_write_json
from trainguard.errors import EXIT_CRASH, EXIT_FAULTY_HARDWARE, EXIT_OK, EXIT_RESUMABLE_STOP
from trainguard.events import EventLog, read_events
from trainguard.run_secret import create_secret
from trainguard.runtime import early_signals
from trainguard.runtime.hang import DUMP_SIGNAL, HangPolicy, dump_dir, remove_empty_dumps, suspect_ranks
from trainguard.runtime.heartbeat import ENV_INCARNATION, Heartbeat, read_heartbeats
from trainguard.runtime.hosts import HostNodes
from trainguard.runtime.lifecycle import ENV_JOB_START
from trainguard.runtime.nodes import ENV_AGENT_REPORT, LocalNodes, NodePool, agent_env
from trainguard.runtime.quiet_torchrun import quiet
from trainguard.runtime.slurm import cancel_pending_tasks
from trainguard.runtime.policy import (
    MEANINGFUL_EXIT_CODES,
    NEVER_RESTART,
    Action,
    Decision,
    Ended,
    Outcome,
    RestartPolicy,
    classify,
    first_rank_with,
    outcome_of,
    stop_explanation,
)

EXCLUDED_FILE = Path("nodes") / "excluded.json"
SUPERVISOR_RANK = -1  # the ``rank`` of the supervisor's own events
ENV_ARRAY_JOB = "SLURM_ARRAY_JOB_ID"


@dataclass
class SupervisorOptions:
    run_dir: Path
    command: list[str]
    max_restarts: int = 10
    backoff: float = 0.5  # seconds before the first restart; doubles per failure without progress
    backoff_max: float = 60.0
    crash_loop: int = 2  # give up after this many failed incarnations in a row without a new step
    hang: HangPolicy = field(default_factory=HangPolicy)
    nnodes: int = 1
    spare_nodes: int = 0
    node_failures: int = 2  # ranks dying this many times on one node exclude it (with more than one node)
    grace: float = 5.0  # seconds the other nodes get to exit after one node's agent failed
    poll: float = 0.1
    restart_command: list[str] | None = None  # for incarnations after the first (default: ``command``)
    # self-test of a spare before it takes a slot (trainguard doctor): the failure's reason, or None
    doctor: Callable[[str], str | None] | None = None
    kill_switch: Path | None = None  # armed: start no ranks, end at once with exit 0
    node_timeout: float = 30.0  # seconds a node's agent may leave the liveness check unanswered (hosts launcher)
    node_check: float = 1.0  # seconds between liveness checks


@dataclass
class Incarnation:
    number: int
    nodes: list[str]
    started: float
    resumed_step: int | None = None
    reached_step: int | None = None
    ended: float | None = None
    exit_code: int | None = None
    outcome: Outcome = Outcome.RUNNING
    failing_rank: int | None = None
    failing_node: str | None = None
    detail: str = ""
    detail_said: bool = False  # ``detail`` printed already (``Supervisor.say_detail``)
    last_progress: float | None = None
    first_step_at: float | None = None

    def row(self) -> dict[str, Any]:
        return {"incarnation": self.number, "nodes": self.nodes, "resumed_step": self.resumed_step,
                "reached_step": self.reached_step, "seconds": round((self.ended or time.time()) - self.started, 2),
                "outcome": self.outcome.value, "exit_code": self.exit_code, "failing_rank": self.failing_rank,
                "failing_node": self.failing_node, "detail": self.detail}

    def ended_as(self) -> Ended:
        return Ended(self.outcome, self.exit_code if self.exit_code is not None else EXIT_CRASH, self.reached_step,
                     self.failing_rank, self.failing_node)


def rank_error_line(failure: dict[str, Any]) -> str:
    """The first line of the error that ended a rank (``Type: message``), from the agent's report of it
    (its ``message``: the text of torchrun's error file, ``launcher.error_text``); "" without one."""
    message = failure.get("message")
    lines = [line.strip() for line in message.splitlines() if line.strip()] if isinstance(message, str) else []
    return lines[0] if lines else ""


def rank_exit_records(beats: dict[int, Heartbeat]) -> tuple[dict[int, int], dict[int, float]]:
    """The exit code each rank recorded in its heartbeat before leaving, and when, by rank."""
    exits = {rank: beat.exit_code for rank, beat in beats.items() if beat.phase == "exit" and beat.exit_code is not None}
    return exits, {rank: beats[rank].time for rank in exits}


def load_excluded(run_dir: Path) -> dict[str, str]:
    path = run_dir / EXCLUDED_FILE
    if not path.exists():
        return {}
    try:
        return {entry["node"]: entry.get("reason", "") for entry in json.loads(path.read_text())}
    except (ValueError, KeyError, TypeError) as exc:
        from trainguard.errors import ConfigError

        raise ConfigError(f"{path}: not a valid excluded-node list ({exc})") from None


def finished_in_array(run_dir: Path, array_job: str) -> bool:
    """True when an earlier task of this job array already ended the run with exit 0."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return False
    return any(event.get("exit_code") == EXIT_OK and event.get("array_job") == array_job
               for event in read_events(path, "supervisor_finished"))


class Supervisor:
    def __init__(self, options: SupervisorOptions, nodes=None, out=None):
        self.o = options
        self.run_dir = Path(options.run_dir)
        self.nodes = nodes or LocalNodes(options.nnodes + options.spare_nodes)
        self.pool = NodePool(list(self.nodes.names), options.nnodes, excluded=load_excluded(self.run_dir))
        self.policy = RestartPolicy(max_restarts=options.max_restarts, crash_loop=options.crash_loop,
                                    backoff=options.backoff, backoff_max=options.backoff_max,
                                    node_failures=options.node_failures, several_nodes=len(self.pool.names) > 1)
        self.out = out
        self.events: EventLog | None = None
        self.incarnations: list[Incarnation] = []
        self.longest_gap = 0.0
        self.stop_signal: str | None = None
        self._forward: list[signal.Signals] = []  # signals received, not yet passed on to the ranks
        self._stops_forwarded = 0
        self._stopped_ranks: set[int] = set()  # the ranks of this incarnation the first stop reached
        self.job_start = time.time()
        self.array_job = os.environ.get(ENV_ARRAY_JOB)
        self._agents: dict[str, Any] = {}
        self._silent_since: dict[str, float] = {}  # node -> when its agent first left a liveness check unanswered
        self._checked = 0.0  # when the nodes' liveness was last checked

    # ------------------------------------------------------------------------------------ helpers
    def say(self, message: str) -> None:
        print(f"trainguard supervisor: {message}", file=self.out or sys.stderr, flush=True)

    def emit(self, kind: str, **fields: Any) -> None:
        if self.events is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.events = EventLog(self.run_dir / "events.jsonl", rank=SUPERVISOR_RANK, host=socket.gethostname())
        self.events.emit(kind, **fields)

    def _first_incarnation_number(self) -> int:
        directory = self.run_dir / "supervisor"
        numbers = [int(p.name.split("_")[1]) for p in directory.glob("incarnation_*") if p.name.split("_")[1].isdigit()]
        return max(numbers, default=-1) + 1

    def _beats(self, number: int) -> dict[int, Heartbeat]:
        return {rank: beat for rank, beat in read_heartbeats(self.run_dir).items() if beat.incarnation == number}

    def _on_signal(self, signum: int, frame) -> None:
        # only flags here: the watch loop passes the signal on (through each node's agent) between polls
        name = signal.Signals(signum).name
        first = self.stop_signal is None
        self.stop_signal = name
        self._forward.append(signal.Signals(signum))
        self.say(f"received {name}: asking every rank to save and stop" if first else f"received {name} again")

    def _signal_ranks(self, number: int, sig: signal.Signals, skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Sends ``sig`` to this incarnation's ranks but ``skip``, node by node through that node's agent."""
        beats = self._beats(number)
        reached = []
        for node, agent in self._agents.items():
            ranks = {beat.pid: rank for rank, beat in beats.items() if beat.node == node and rank not in skip}
            reached += self.nodes.signal_ranks(node, agent, ranks, sig)
        return sorted(reached)

    def _forward_signals(self, number: int) -> None:
        while self._forward:
            self._forward.pop(0)
            self._stops_forwarded += 1
            if self._stops_forwarded > 1:  # a second stop: the newest committed checkpoint is the resume point
                self._signal_ranks(number, signal.SIGUSR1)
                self._kill_all()
        if self._stops_forwarded == 1:
            # a rank still starting has no heartbeat to be found by: it gets the stop once it has one
            # (its handlers are installed before its first heartbeat), and no rank gets it twice
            # (a second SIGUSR1 would end it at once, unsaved)
            self._stopped_ranks.update(self._signal_ranks(number, signal.SIGUSR1, skip=self._stopped_ranks))

    def _kill_all(self) -> None:
        for node, agent in self._agents.items():
            if agent.poll() is None:
                self.nodes.stop(node, agent)
        for agent in self._agents.values():
            agent.wait()

    # ---------------------------------------------------------------------------------------- run
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in early_signals.STOP_SIGNALS}
        for held in early_signals.release():  # received while the command was still starting
            self._on_signal(held, None)
        try:
            return self._run()
        except KeyboardInterrupt:
            self._kill_all()
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.events is not None:
                self.events.close()

    def _nothing_to_do(self) -> str | None:
        if self.o.kill_switch is not None and Path(self.o.kill_switch).exists():
            return f"kill switch {self.o.kill_switch} is armed"
        if self.array_job and finished_in_array(self.run_dir, self.array_job):
            return f"an earlier task of job array {self.array_job} finished the run"
        return None

    def _run(self) -> int:
        o = self.o
        if not self.pool.complete:
            self.say(f"only {len(self.pool.slots)} usable node(s) for {o.nnodes} slot(s) "
                     f"(excluded: {', '.join(self.pool.excluded) or 'none'}); not starting")
            return EXIT_FAULTY_HARDWARE
        if isinstance(self.nodes, HostNodes):  # its agents answer only requests proved with the run secret
            self.nodes.secret = create_secret(self.run_dir)
        number = self._first_incarnation_number()
        pending_recovery: dict[str, Any] | None = None
        self.emit("supervisor_started", command=o.command, nnodes=o.nnodes, spare_nodes=o.spare_nodes,
                  nodes=list(self.pool.slots), spares=self.pool.spares, max_restarts=o.max_restarts)
        while True:
            if (why := self._nothing_to_do()) is not None:
                return self._end_without_ranks(why)
            if self.stop_signal and not self.incarnations:  # stopped before anything started
                return self._end_without_ranks(f"received {self.stop_signal}", EXIT_RESUMABLE_STOP)
            inc = self._run_incarnation(number, pending_recovery)
            ended = inc.ended_as()
            decision = self.policy.observe(ended, stop_requested=self.stop_signal is not None)
            if decision is not None:
                return self._finish(inc, decision.exit_code)
            excluded = self.policy.node_to_exclude(ended, self.pool.slots)
            if excluded is not None:
                if not self._replace(inc, excluded.node, excluded.reason.value):
                    return self._give_up(inc, "no spare node", ended.exit_code)
                self.policy.replaced_node()
            elif ended.exit_code == EXIT_FAULTY_HARDWARE:
                return self._give_up(inc, "faulty hardware, but no node could be named", ended.exit_code)
            decision = self.policy.next_attempt(ended)
            if decision.action is Action.GIVE_UP:
                return self._give_up(inc, decision.reason, decision.exit_code)
            pending_recovery = self._announce_restart(inc, decision)
            time.sleep(decision.delay)
            if self.stop_signal:  # asked to stop while waiting: the last checkpoint is the resume point
                return self._finish(inc, EXIT_RESUMABLE_STOP)
            number += 1

    def _replace(self, inc: Incarnation, node: str, reason: str) -> bool:
        """Excludes ``node`` and gives its slot to a spare that passes its self-test; False if none is left."""
        spare = self.pool.exclude(node, inc.detail or reason)
        self._save_excluded()
        self.emit("node_excluded", node=node, reason=reason, detail=inc.detail, exit_code=inc.exit_code,
                  ranks=[inc.failing_rank] if inc.failing_rank is not None else [], spare=spare)
        self.say(f"node {node} excluded ({inc.detail or reason})")
        while spare is not None and self.o.doctor is not None and (why := self.o.doctor(spare)) is not None:
            failed, spare = spare, self.pool.exclude(spare, f"doctor: {why}")  # the next spare, if any
            self._save_excluded()
            self.emit("node_excluded", node=failed, reason="doctor", detail=why, ranks=[], spare=spare)
            self.say(f"spare node {failed} failed its self-test ({why}): excluded")
        if spare is None:
            self.say(f"no spare node left to take {node}'s slot: the world size must stay "
                     f"{self.o.nnodes} node(s), stopping")
            return False
        self.emit("spare_started", node=spare, replaces=node, slot=self.pool.slots.index(spare))
        self.say(f"spare node {spare} takes the slot of {node}")
        return True

    def _announce_restart(self, inc: Incarnation, decision: Decision) -> dict[str, Any]:
        restarts, code = self.policy.restarts, inc.exit_code
        self.say(f"incarnation {inc.number} {inc.outcome.value} (exit {code}); restart {restarts}/{self.o.max_restarts} "
                 f"in {decision.delay:.1f}s" + (f"; failing rank {inc.failing_rank} on {inc.failing_node}"
                                                if inc.failing_rank is not None else ""))
        self.emit("restart", step=inc.reached_step, incarnation=inc.number + 1, reason=inc.outcome.value,
                  exit_code=code, failing_rank=inc.failing_rank, failing_node=inc.failing_node,
                  detail=inc.detail, backoff=decision.delay, restarts=restarts)
        return {"reason": inc.outcome.value, "exit_code": code, "failing_rank": inc.failing_rank,
                "failing_node": inc.failing_node, "failed_incarnation": inc.number,
                "failed_at": inc.last_progress or inc.started, "detected_at": inc.ended,
                "reached_step": inc.reached_step, "backoff": decision.delay}

    # ------------------------------------------------------------------------------- incarnation
    def _run_incarnation(self, number: int, recovery: dict[str, Any] | None) -> Incarnation:
        o = self.o
        inc = Incarnation(number=number, nodes=list(self.pool.slots), started=time.time())
        self.incarnations.append(inc)
        report_dir = self.run_dir / "supervisor" / f"incarnation_{number}"
        report_dir.mkdir(parents=True, exist_ok=True)
        endpoint = self.nodes.endpoint(self.pool.slots[0])
        self._agents = {}
        self._stopped_ranks = set()
        for slot, node in enumerate(self.pool.slots):
            env = agent_env(node, slot, o.nnodes, endpoint, {
                ENV_INCARNATION: str(number), ENV_JOB_START: repr(self.job_start),
                ENV_AGENT_REPORT: str(report_dir / f"{node}.json"),
            })
            command = o.restart_command if (recovery is not None and o.restart_command) else o.command
            self._agents[node] = self.nodes.start(node, quiet(command), env)
        self.emit("incarnation_started", incarnation=number, nodes=list(self.pool.slots), spares=self.pool.spares,
                  pids={node: proc.pid for node, proc in self._agents.items()})
        exits: dict[str, tuple[int, float]] = {}
        first_failure: float | None = None
        hung = lost = False
        self._silent_since: dict[str, float] = {}
        self._checked = 0.0
        while True:
            self._forward_signals(number)
            now = time.time()
            for node, proc in self._agents.items():
                code = proc.poll()
                if code is not None and node not in exits:
                    exits[node] = (code, now)
                    if code != 0 and first_failure is None:
                        first_failure = now
            beats = self._beats(number)
            self._observe(inc, beats, recovery)
            if recovery is not None and inc.first_step_at is not None:
                self._record_recovery(inc, recovery, beats)
                recovery = None
            if len(exits) == len(self._agents):
                break
            if first_failure is not None and now - first_failure > o.grace:
                lost = lost or self._lost_node(inc, exits, now, after="failure")
                self._kill_all()  # the others wait on a dead peer: collectives would time out much later
                continue
            if self._lost_node(inc, exits, now):
                lost = True
                self._kill_all()
                for node, proc in self._agents.items():
                    exits.setdefault(node, (proc.returncode, time.time()))
                break
            if first_failure is None and self._hung(inc, beats, now):
                # a node nobody can reach stops its peers' collectives: that is a lost node, not a hang
                lost = self._lost_node(inc, exits, now, after="hang")
                hung = not lost
                if lost:
                    self._kill_all()
                else:
                    self._dump_and_kill(inc, beats)
                for node, proc in self._agents.items():
                    exits.setdefault(node, (proc.returncode, time.time()))
                break
            time.sleep(o.poll)
        inc.ended = time.time()
        beats = self._beats(number)
        self._observe(inc, beats, None)
        remove_empty_dumps(self.run_dir, number)
        rank_exits, exit_times = rank_exit_records(beats)
        if hung:
            inc.outcome, inc.exit_code = Outcome.HANG, EXIT_CRASH
        elif lost:
            inc.outcome, inc.exit_code = Outcome.NODE_LOST, EXIT_CRASH
        else:
            inc.exit_code = classify([code for code, _ in exits.values()], rank_exits)
            if self.stop_signal and inc.exit_code not in NEVER_RESTART:
                # asked to stop (a time limit, scancel) before the ranks could save: whatever ended them,
                # the newest committed checkpoint is the resume point
                inc.exit_code = EXIT_RESUMABLE_STOP
            inc.outcome = outcome_of(inc.exit_code)
        if inc.outcome in (Outcome.FAILED, Outcome.HANG):
            self._attribute(inc, exits, beats, rank_exits, exit_times)
        self.emit("incarnation_ended", step=inc.reached_step, **inc.row(),
                  exit_codes={node: code for node, (code, _) in exits.items()}, rank_exit_codes=rank_exits)
        return inc

    def _observe(self, inc: Incarnation, beats: dict[int, Heartbeat], recovery) -> None:
        if not beats:
            return
        inc.last_progress = max(beat.time for beat in beats.values())
        self.longest_gap = max([self.longest_gap] + [beat.longest_gap for beat in beats.values()])
        resumed = [beat.resumed for beat in beats.values() if beat.resumed is not None]
        if inc.resumed_step is None and resumed:
            inc.resumed_step = resumed[0]
        stepped = [beat.step for beat in beats.values() if beat.phase in ("step", "save", "exit")]
        if stepped:
            inc.reached_step = max(stepped)
        firsts = [beat.marks.get("first_step") for beat in beats.values()]
        if inc.first_step_at is None and firsts and all(firsts) and len(beats) >= self._expected_ranks(beats):
            inc.first_step_at = max(firsts)

    @staticmethod
    def _expected_ranks(beats: dict[int, Heartbeat]) -> int:
        return max(beats) + 1

    def _lost_node(self, inc: Incarnation, exits: dict[str, tuple[int, float]], now: float,
                   after: str | None = None) -> bool:
        """True when a running node's agent has not answered the liveness check for ``node_timeout``
        seconds (names the node in ``inc``); checked every ``node_check`` seconds. ``after`` a hang or
        a failure, checked at once, and a node that fails this check and failed the one before is lost
        without waiting for the timeout: it explains the hang."""
        if after is None and now - self._checked < self.o.node_check:
            return False
        self._checked = now
        for node in self._agents:
            answered = None if node in exits else self.nodes.answers(node)
            if answered is None or answered:
                self._silent_since.pop(node, None)
                continue
            since = self._silent_since.setdefault(node, now)
            failed_before = now - since >= self.o.node_check  # an earlier check, not one just made
            if now - since >= self.o.node_timeout or (after is not None and failed_before):
                inc.failing_node = node
                inc.detail = (f"node {node} lost: its agent has not answered for {now - since:.1f}s "
                              + (f"when the incarnation's {after} was noticed" if after else
                                 f"(--node-timeout {self.o.node_timeout:g}s)") + "; link down or host gone")
                self.say_detail(inc)
                self.emit("node_lost", step=inc.reached_step, incarnation=inc.number, node=node,
                          silent_seconds=round(now - since, 2), noticed_by=after or "liveness")
                return True
        return False

    def _hung(self, inc: Incarnation, beats: dict[int, Heartbeat], now: float) -> bool:
        training = any(beat.phase in ("train", "step", "save") for beat in beats.values())
        timeout = self.o.hang.timeout(self.longest_gap, training)
        last = inc.last_progress or inc.started
        if now - last <= timeout:
            return False
        inc.detail = f"no heartbeat progress for {now - last:.1f}s (timeout {timeout:.1f}s)"
        self.say_detail(inc, f"hang detected in incarnation {inc.number}")
        return True

    def _dump_and_kill(self, inc: Incarnation, beats: dict[int, Heartbeat]) -> None:
        signalled = self._signal_ranks(inc.number, DUMP_SIGNAL)
        directory = dump_dir(self.run_dir, inc.number)
        deadline = time.time() + 3.0
        while time.time() < deadline:
            if all((directory / f"rank_{rank}.txt").exists() and (directory / f"rank_{rank}.txt").stat().st_size
                   for rank in signalled):
                break
            time.sleep(0.05)
        time.sleep(0.1)  # let the dumps finish writing their last frames
        self._kill_all()
        dumps = {}
        for rank in signalled:
            path = directory / f"rank_{rank}.txt"
            if path.exists():
                dumps[rank] = path.read_text(errors="replace")
        suspects = suspect_ranks(beats, dumps)
        if len(suspects) == 1:
            inc.failing_rank = suspects[0]
            inc.failing_node = beats[suspects[0]].node
        self.emit("hang_detected", step=inc.reached_step, incarnation=inc.number, detail=inc.detail,
                  dumps=str(directory), ranks_dumped=sorted(dumps), suspect_ranks=suspects)

    # ------------------------------------------------------------------------------- attribution
    def _attribute(self, inc: Incarnation, exits: dict[str, tuple[int, float]], beats: dict[int, Heartbeat],
                   rank_exits: dict[int, int], exit_times: dict[int, float]) -> None:
        """Names the failing rank and node: faulty_ranks.json, the ranks' exit records, the agents'
        reports, then exit order."""
        node_of = {rank: beat.node for rank, beat in beats.items()}
        if inc.exit_code == EXIT_FAULTY_HARDWARE:
            from trainguard.guards.sdc import faulty_ranks_path

            path = faulty_ranks_path(self.run_dir)
            try:
                faulty = json.loads(path.read_text())
            except (OSError, ValueError):
                faulty = []
            if faulty:
                entry = faulty[-1]
                inc.failing_rank = int(entry["rank"])
                inc.failing_node = node_of.get(inc.failing_rank) or entry.get("host")
                inc.detail = f"rank {inc.failing_rank} faulty ({len(entry.get('strikes', []))} SDC strikes, {path})"
                return
        if inc.failing_rank is not None:
            return
        if inc.exit_code in MEANINGFUL_EXIT_CODES:
            rank = first_rank_with(inc.exit_code, rank_exits, exit_times)
            if rank is not None:
                inc.failing_rank, inc.failing_node = rank, node_of[rank]
                inc.detail = inc.detail or f"rank {rank} on {node_of[rank]} exited {inc.exit_code} (its exit record)"
                return
        failures = []
        for node in inc.nodes:
            report = self.run_dir / "supervisor" / f"incarnation_{inc.number}" / f"{node}.json"
            try:
                for failure in json.loads(report.read_text())["failures"]:
                    failures.append((failure, node))
            except (OSError, ValueError, KeyError):
                continue
        # a rank killed by a signal is the cause, the others failed because their peer vanished: the
        # agent reports the first failure it saw, and a rank that ended without an exit heartbeat died
        # without a word (SIGKILL, OOM killer, segfault)
        signalled = [(f, node) for f, node in failures if f["exitcode"] < 0]
        silent = sorted(rank for rank, beat in beats.items() if beat.phase != "exit")
        if not signalled and silent and len(silent) < len(beats) and inc.outcome is not Outcome.HANG:
            inc.failing_rank = silent[0]
            inc.failing_node = node_of[silent[0]]
            inc.detail = inc.detail or f"rank {silent[0]} on {inc.failing_node} died without an exit (killed)"
            return
        if failures:
            failures.sort(key=lambda item: (item[0]["exitcode"] >= 0, item[0].get("timestamp") or 0))
            failure, node = failures[0]
            inc.failing_rank = failure["rank"]
            inc.failing_node = node_of.get(failure["rank"], node)
            how = f"signal {failure['signal']}" if failure.get("signal") else f"exit {failure['exitcode']}"
            error = rank_error_line(failure)
            inc.detail = inc.detail or f"rank {failure['rank']} on {inc.failing_node} failed ({how})" + (
                f": {error}" if error else "")
            if error:  # otherwise only in the agent's report: a rank's error is said where the user looks
                self.say_detail(inc)
            return
        failed = sorted((at, node, code) for node, (code, at) in exits.items() if code != 0)
        if failed and inc.outcome is not Outcome.HANG:
            at, node, code = failed[0]
            inc.failing_node = node
            inc.detail = inc.detail or f"agent on {node} exited {code}"

    def _save_excluded(self) -> None:
        entries = [{"node": node, "reason": reason, "time": time.time()} for node, reason in self.pool.excluded.items()]
        path = self.run_dir / EXCLUDED_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, entries)

    # -------------------------------------------------------------------------------- reporting
    def _record_recovery(self, inc: Incarnation, recovery: dict[str, Any], beats: dict[int, Heartbeat]) -> None:
        def latest(mark: str) -> float | None:
            values = [beat.marks.get(mark) for beat in beats.values()]
            return max(values) if values and all(values) else None

        init, resume, train = latest("init"), latest("resume"), latest("train")
        failed_at, detected_at = recovery["failed_at"], recovery["detected_at"]
        first_step = inc.first_step_at
        parts = {
            "detection": detected_at - failed_at,
            "restart": inc.started - detected_at,  # backoff and stopping the old processes
            "process_start": (init - inc.started) if init else None,  # process start, imports, rendezvous
            "init": (resume - init) if resume and init else None,  # model build until the load begins
            "checkpoint_load": (train - resume) if train and resume else None,
            "first_step": (first_step - train) if train else None,
        }
        total = first_step - failed_at
        own = total - (parts["process_start"] or 0.0)
        redone = None
        if recovery["reached_step"] is not None and inc.resumed_step is not None:
            redone = max(0, recovery["reached_step"] - inc.resumed_step)
        self.emit("recovered", step=inc.resumed_step, incarnation=inc.number, reason=recovery["reason"],
                  failing_rank=recovery["failing_rank"], failing_node=recovery["failing_node"],
                  steps_redone=redone, seconds=total, trainguard_seconds=own,
                  parts={k: (round(v, 4) if v is not None else None) for k, v in parts.items()},
                  backoff=recovery["backoff"])
        self.say(f"recovered in {total:.2f}s (detection {parts['detection']:.2f}s, restart {parts['restart']:.2f}s, "
                 f"first step done at step {(inc.resumed_step or 0) + 1}); {redone} step(s) redone")

    def _summary(self) -> None:
        self.say("incarnations:")
        for inc in self.incarnations:
            row = inc.row()
            where = f" rank {row['failing_rank']} on {row['failing_node']}" if row["failing_node"] else ""
            self.say(f"  #{row['incarnation']} nodes={','.join(row['nodes'])} resumed_step={row['resumed_step']} "
                     f"reached_step={row['reached_step']} {row['seconds']}s {row['outcome']} exit={row['exit_code']}"
                     f"{where}{': ' + row['detail'] if row['detail'] else ''}")

    def say_detail(self, inc: Incarnation, heading: str = "") -> None:
        """Prints why ``inc`` ended, once: a run not restarted does not say it again when it gives up."""
        self.say(f"{heading or f'incarnation {inc.number}'}: {inc.detail}")
        inc.detail_said = True

    def _give_up(self, inc: Incarnation, why: str, code: int) -> int:
        code = code if code not in (EXIT_OK, None) else EXIT_CRASH
        if self.o.max_restarts > 0 or self.o.spare_nodes > 0 or self.o.nnodes > 1:
            self.say(f"giving up: {why}")
            self._summary()
        elif not inc.detail_said:  # a run nobody asked to restart: still one line saying what ended it
            self.say(f"{inc.detail or 'a rank failed'}: exit {code}, not restarted (--max-restarts 0)")
        high_water = self.policy.high_water
        self.emit("supervisor_gave_up", step=high_water if high_water >= 0 else None, reason=why,
                  exit_code=code, incarnations=[i.row() for i in self.incarnations])
        return code

    def _finish(self, inc: Incarnation, code: int) -> int:
        explanation = stop_explanation(code, inc.reached_step, inc.detail, self.stop_signal)
        if explanation is not None:
            self.say(explanation)
        if len(self.incarnations) > 1:
            self._summary()
        self.emit("supervisor_finished", step=inc.reached_step, exit_code=code, outcome=inc.outcome.value,
                  stop_signal=self.stop_signal, array_job=self.array_job,
                  incarnations=[i.row() for i in self.incarnations])
        if code == EXIT_OK and self.array_job:
            self._end_array()
        return code

    def _end_without_ranks(self, why: str, code: int = EXIT_OK) -> int:
        self.say(f"{why}: starting no ranks, exit {code}")
        outcome = "nothing_to_do" if code == EXIT_OK else Outcome.STOPPED.value
        self.emit("supervisor_finished", step=None, exit_code=code, outcome=outcome, reason=why,
                  stop_signal=self.stop_signal, array_job=self.array_job,
                  incarnations=[i.row() for i in self.incarnations])
        if code == EXIT_OK and self.array_job:
            self._end_array()
        return code

    def _end_array(self) -> None:
        """The run is over: the job array's remaining tasks would each take an allocation for nothing."""
        cancelled = cancel_pending_tasks(self.array_job)
        if cancelled:
            self.say(f"cancelled the pending tasks of job array {self.array_job}")
