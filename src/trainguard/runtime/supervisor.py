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
from trainguard.errors import (
    EXIT_CRASH,
    EXIT_DATA_SKIP_ABORT,
    EXIT_FAULTY_HARDWARE,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    EXIT_RESUMABLE_STOP,
    EXIT_USAGE,
)
from trainguard.events import EventLog
from trainguard.runtime.hang import DUMP_SIGNAL, HangPolicy, dump_dir, remove_empty_dumps, suspect_ranks
from trainguard.runtime.heartbeat import ENV_INCARNATION, Heartbeat, read_heartbeats
from trainguard.runtime.lifecycle import ENV_JOB_START
from trainguard.runtime.nodes import ENV_AGENT_REPORT, LocalNodes, NodePool, agent_env, kill_tree

NEVER_RESTART = (EXIT_OK, EXIT_USAGE, EXIT_DATA_SKIP_ABORT, EXIT_NO_CHECKPOINT, EXIT_RESUMABLE_STOP)
EXCLUDED_FILE = Path("nodes") / "excluded.json"
SUPERVISOR_RANK = -1  # the ``rank`` of the supervisor's own events


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


@dataclass
class Incarnation:
    number: int
    nodes: list[str]
    started: float
    resumed_step: int | None = None
    reached_step: int | None = None
    ended: float | None = None
    exit_code: int | None = None
    outcome: str = "running"  # finished | failed | hang | stopped
    failing_rank: int | None = None
    failing_node: str | None = None
    detail: str = ""
    last_progress: float | None = None
    first_step_at: float | None = None

    def row(self) -> dict[str, Any]:
        return {"incarnation": self.number, "nodes": self.nodes, "resumed_step": self.resumed_step,
                "reached_step": self.reached_step, "seconds": round((self.ended or time.time()) - self.started, 2),
                "outcome": self.outcome, "exit_code": self.exit_code, "failing_rank": self.failing_rank,
                "failing_node": self.failing_node, "detail": self.detail}


def backoff_seconds(base: float, cap: float, failures_without_progress: int) -> float:
    """``base`` after a failure that followed progress, doubling for each failure in a row without."""
    return min(cap, base * 2 ** max(0, failures_without_progress - 1))


def classify(codes: list[int]) -> int:
    """The exit code that explains an incarnation from its agents' codes (signals count as crashes)."""
    from trainguard.runtime.launcher import exit_code_of

    failed = [code for code in codes if code != 0]
    if not failed:
        return EXIT_OK
    return exit_code_of(failed)


def load_excluded(run_dir: Path) -> dict[str, str]:
    path = run_dir / EXCLUDED_FILE
    if not path.exists():
        return {}
    try:
        return {entry["node"]: entry.get("reason", "") for entry in json.loads(path.read_text())}
    except (ValueError, KeyError, TypeError) as exc:
        from trainguard.errors import ConfigError

        raise ConfigError(f"{path}: not a valid excluded-node list ({exc})") from None


class Supervisor:
    def __init__(self, options: SupervisorOptions, nodes=None, out=None):
        self.o = options
        self.run_dir = Path(options.run_dir)
        self.nodes = nodes or LocalNodes(options.nnodes + options.spare_nodes)
        self.pool = NodePool(list(self.nodes.names), options.nnodes, excluded=load_excluded(self.run_dir))
        self.out = out
        self.events: EventLog | None = None
        self.incarnations: list[Incarnation] = []
        self.high_water = -1  # the highest step any incarnation completed
        self.longest_gap = 0.0
        self.node_deaths: dict[str, int] = {}
        self.stop_signal: str | None = None
        self.job_start = time.time()
        self._agents: dict[str, Any] = {}

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
        name = signal.Signals(signum).name
        first = self.stop_signal is None
        self.stop_signal = name
        self.say(f"received {name}: asking every rank to save and stop" if first else f"received {name} again")
        for beat in read_heartbeats(self.run_dir).values():
            if self.incarnations and beat.incarnation == self.incarnations[-1].number:
                try:
                    os.kill(beat.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        if not first or not self.incarnations:
            self._kill_all()

    def _kill_all(self) -> None:
        for proc in self._agents.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
        for proc in self._agents.values():
            proc.wait()

    # ---------------------------------------------------------------------------------------- run
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
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

    def _run(self) -> int:
        o = self.o
        if not self.pool.complete:
            self.say(f"only {len(self.pool.slots)} usable node(s) for {o.nnodes} slot(s) "
                     f"(excluded: {', '.join(self.pool.excluded) or 'none'}); not starting")
            return EXIT_FAULTY_HARDWARE
        number = self._first_incarnation_number()
        restarts = 0
        failures_without_progress = 0
        pending_recovery: dict[str, Any] | None = None
        self.emit("supervisor_started", command=o.command, nnodes=o.nnodes, spare_nodes=o.spare_nodes,
                  nodes=list(self.pool.slots), spares=self.pool.spares, max_restarts=o.max_restarts)
        while True:
            inc = self._run_incarnation(number, pending_recovery)
            pending_recovery = None
            code = inc.exit_code
            progressed = inc.reached_step is not None and inc.reached_step > self.high_water
            if inc.reached_step is not None:
                self.high_water = max(self.high_water, inc.reached_step)
            if inc.outcome == "finished" or code in NEVER_RESTART or self.stop_signal:
                return self._finish(inc, code if code is not None else EXIT_CRASH)
            failures_without_progress = 0 if progressed else failures_without_progress + 1

            excluded_node = self._node_to_exclude(inc)
            if excluded_node is not None:
                spare = self.pool.exclude(excluded_node, inc.detail or inc.outcome)
                self._save_excluded()
                self.emit("node_excluded", node=excluded_node, reason=inc.outcome, exit_code=code,
                          ranks=[inc.failing_rank] if inc.failing_rank is not None else [], spare=spare)
                self.say(f"node {excluded_node} excluded ({inc.detail or inc.outcome})")
                while spare is not None and o.doctor is not None and (why := o.doctor(spare)) is not None:
                    failed, spare = spare, self.pool.exclude(spare, f"doctor: {why}")  # the next spare, if any
                    self._save_excluded()
                    self.emit("node_excluded", node=failed, reason="doctor", detail=why, ranks=[], spare=spare)
                    self.say(f"spare node {failed} failed its self-test ({why}): excluded")
                if spare is None:
                    self.say(f"no spare node left to take {excluded_node}'s slot: the world size must stay "
                             f"{o.nnodes} node(s), stopping")
                    return self._give_up(inc, "no spare node", code or EXIT_CRASH)
                self.emit("spare_started", node=spare, replaces=excluded_node, slot=self.pool.slots.index(spare))
                self.say(f"spare node {spare} takes the slot of {excluded_node}")
                failures_without_progress = 0  # a new node deserves a fresh count
            elif code == EXIT_FAULTY_HARDWARE:
                return self._give_up(inc, "faulty hardware, but no node could be named", code)

            if restarts >= o.max_restarts:
                return self._give_up(inc, f"--max-restarts {o.max_restarts} used up", code or EXIT_CRASH)
            if failures_without_progress >= o.crash_loop:
                return self._give_up(inc, f"crash loop: {failures_without_progress} failures in a row without "
                                          f"a new step (highest step {self.high_water})", code or EXIT_CRASH)
            delay = backoff_seconds(o.backoff, o.backoff_max, max(1, failures_without_progress))
            restarts += 1
            self.say(f"incarnation {inc.number} {inc.outcome} (exit {code}); restart {restarts}/{o.max_restarts} "
                     f"in {delay:.1f}s" + (f"; failing rank {inc.failing_rank} on {inc.failing_node}"
                                           if inc.failing_rank is not None else ""))
            pending_recovery = {"reason": inc.outcome, "exit_code": code, "failing_rank": inc.failing_rank,
                                "failing_node": inc.failing_node, "failed_incarnation": inc.number,
                                "failed_at": inc.last_progress or inc.started, "detected_at": inc.ended,
                                "reached_step": inc.reached_step, "backoff": delay}
            self.emit("restart", step=inc.reached_step, incarnation=number + 1, reason=inc.outcome,
                      exit_code=code, failing_rank=inc.failing_rank, failing_node=inc.failing_node,
                      detail=inc.detail, backoff=delay, restarts=restarts)
            time.sleep(delay)
            if self.stop_signal:  # asked to stop while waiting: the last checkpoint is the resume point
                return self._finish(inc, EXIT_RESUMABLE_STOP)
            number += 1

    # ------------------------------------------------------------------------------- incarnation
    def _run_incarnation(self, number: int, recovery: dict[str, Any] | None) -> Incarnation:
        o = self.o
        inc = Incarnation(number=number, nodes=list(self.pool.slots), started=time.time())
        self.incarnations.append(inc)
        report_dir = self.run_dir / "supervisor" / f"incarnation_{number}"
        report_dir.mkdir(parents=True, exist_ok=True)
        endpoint = self.nodes.endpoint(self.pool.slots[0])
        self._agents = {}
        for slot, node in enumerate(self.pool.slots):
            env = agent_env(node, slot, o.nnodes, endpoint, {
                ENV_INCARNATION: str(number), ENV_JOB_START: repr(self.job_start),
                ENV_AGENT_REPORT: str(report_dir / f"{node}.json"),
            })
            command = o.restart_command if (recovery is not None and o.restart_command) else o.command
            self._agents[node] = self.nodes.start(node, command, env)
        self.emit("incarnation_started", incarnation=number, nodes=list(self.pool.slots), spares=self.pool.spares,
                  pids={node: proc.pid for node, proc in self._agents.items()})
        exits: dict[str, tuple[int, float]] = {}
        first_failure: float | None = None
        hung = False
        while True:
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
                self._kill_all()  # the others wait on a dead peer: collectives would time out much later
                continue
            if first_failure is None and self._hung(inc, beats, now):
                hung = True
                self._dump_and_kill(inc, beats)
                for node, proc in self._agents.items():
                    exits.setdefault(node, (proc.returncode, time.time()))
                break
            time.sleep(o.poll)
        inc.ended = time.time()
        self._observe(inc, self._beats(number), None)
        remove_empty_dumps(self.run_dir, number)
        codes = [code for code, _ in exits.values()]
        if hung:
            inc.outcome, inc.exit_code = "hang", EXIT_CRASH
        else:
            inc.exit_code = classify(codes)
            inc.outcome = "finished" if inc.exit_code == EXIT_OK else (
                "stopped" if inc.exit_code == EXIT_RESUMABLE_STOP else "failed")
        if inc.outcome != "finished":
            self._attribute(inc, exits)
        self.emit("incarnation_ended", step=inc.reached_step, **inc.row(),
                  exit_codes={node: code for node, (code, _) in exits.items()})
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

    def _hung(self, inc: Incarnation, beats: dict[int, Heartbeat], now: float) -> bool:
        training = any(beat.phase in ("train", "step", "save") for beat in beats.values())
        timeout = self.o.hang.timeout(self.longest_gap, training)
        last = inc.last_progress or inc.started
        if now - last <= timeout:
            return False
        inc.detail = f"no heartbeat progress for {now - last:.1f}s (timeout {timeout:.1f}s)"
        self.say(f"hang detected in incarnation {inc.number}: {inc.detail}")
        return True

    def _dump_and_kill(self, inc: Incarnation, beats: dict[int, Heartbeat]) -> None:
        signalled = []
        for rank, beat in beats.items():
            try:
                os.kill(beat.pid, DUMP_SIGNAL)
                signalled.append(rank)
            except (ProcessLookupError, PermissionError):
                pass
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
        suspects = suspect_ranks(dumps)
        if len(suspects) == 1:
            inc.failing_rank = suspects[0]
            inc.failing_node = beats[suspects[0]].node
        self.emit("hang_detected", step=inc.reached_step, incarnation=inc.number, detail=inc.detail,
                  dumps=str(directory), ranks_dumped=sorted(dumps), suspect_ranks=suspects)

    # ------------------------------------------------------------------------------- attribution
    def _attribute(self, inc: Incarnation, exits: dict[str, tuple[int, float]]) -> None:
        """Names the failing rank and node: faulty_ranks.json, then agents' reports, then exit order."""
        beats = self._beats(inc.number)
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
        if not signalled and silent and len(silent) < len(beats) and inc.outcome != "hang":
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
            inc.detail = inc.detail or f"rank {failure['rank']} on {inc.failing_node} failed ({how})"
            return
        failed = sorted((at, node, code) for node, (code, at) in exits.items() if code != 0)
        if failed and inc.outcome != "hang":
            at, node, code = failed[0]
            inc.failing_node = node
            inc.detail = inc.detail or f"agent on {node} exited {code}"

    def _node_to_exclude(self, inc: Incarnation) -> str | None:
        node = inc.failing_node
        if node is None or node not in self.pool.slots:
            return None
        if inc.exit_code == EXIT_FAULTY_HARDWARE:
            return node
        if len(self.pool.names) < 2 or inc.failing_rank is None:
            return None  # on a single node a repeated death is a crash loop, not a node to exclude
        self.node_deaths[node] = self.node_deaths.get(node, 0) + 1
        return node if self.node_deaths[node] >= self.o.node_failures else None

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

    def _give_up(self, inc: Incarnation, why: str, code: int) -> int:
        code = code if code not in (EXIT_OK, None) else EXIT_CRASH
        if self.o.max_restarts > 0 or self.o.spare_nodes > 0 or self.o.nnodes > 1:
            self.say(f"giving up: {why}")
            self._summary()
        self.emit("supervisor_gave_up", step=self.high_water if self.high_water >= 0 else None, reason=why,
                  exit_code=code, incarnations=[i.row() for i in self.incarnations])
        return code

    def _finish(self, inc: Incarnation, code: int) -> int:
        if len(self.incarnations) > 1:
            self._summary()
        self.emit("supervisor_finished", step=inc.reached_step, exit_code=code, outcome=inc.outcome,
                  stop_signal=self.stop_signal, incarnations=[i.row() for i in self.incarnations])
        return code
