"""What a run directory says about its run, read into one typed summary shared by ``report`` and ``status``.

Sources: ``events.jsonl`` (every decision; see docs/events.md), the durable checkpoints under
``checkpoints/`` (manifest and ``health_ckpts.json``) and the heartbeats ``heartbeats/rank_R.json``.
Event kinds this module does not know are ignored, and fields are read by name and defensively, so a
newer trainer's log still reads. Nothing here writes or verifies anything: it is cheap enough to run
on a live run every few seconds.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.fs.layout import HEALTH_FILE
from trainguard.errors import CheckpointError, ConfigError
from trainguard.events import read_events
from trainguard.guards.health import marked_unhealthy, read_health_records

EVENTS_FILE = "events.jsonl"
HEARTBEAT_DIR = "heartbeats"
# A run whose newest heartbeat or event is younger than this is shown as live.
LIVE_SECONDS = 120.0

# Events that end an attempt abnormally, most specific first; the first found names the incident's cause.
_CAUSE_KINDS = ("hang_detected", "node_excluded", "data_skip_abort", "fault_injected")
# Recovery and restart actions written by the supervisor, the local tier and the backup (shown when present).
ACTION_KINDS = (
    "incarnation", "restart", "hang_detected", "node_excluded", "local_recovery", "repair", "rollback",
    "mirror_uploaded",
)


@dataclass(frozen=True)
class StepPoint:
    step: int
    time: float
    loss: float | None
    global_norm: float | None
    skipped: bool
    attempt: int
    """Which start of the run did the step (0 = the first): a step redone after a resume appears once per attempt."""


@dataclass(frozen=True)
class SkipMark:
    step: int
    time: float
    global_norm: float | None
    threshold: float | None
    nan: bool
    reason: str
    """``data_skip``, ``data_skip_abort``, ``sdc reproducible`` or ``sdc unverified`` (no rerun)."""


@dataclass(frozen=True)
class Detection:
    step: int | None
    time: float
    rank: int | None
    point: str
    level: int | None
    value: float | None
    rule: str
    device: str
    verdict: str | None
    """This rank's rerun verdict at the step (``transient``, ``reproducible``, ``unverified``, ``faulty``,
    ``none``: no level-1 value of its own), None when no verdict was recorded."""


@dataclass
class CheckpointFact:
    step: int
    tier: str
    time: float | None
    """When it was committed (or the manifest's creation time when no event recorded it)."""
    name: str = ""
    seconds: float | None = None
    size_bytes: int | None = None
    health: str | None = None
    """``healthy``, ``unhealthy`` or None when the run does not monitor health."""
    present: bool = False
    """Still on disk now (durable tier only; other tiers are known from events only)."""
    deleted: str | None = None
    """Why it was deleted, when an event says so."""
    blocked_s: float | None = None
    """Durable tier: what its save blocked the loop (``checkpoint_saved``), the wait for the previous
    save to commit included."""


@dataclass(frozen=True)
class Attempt:
    index: int
    started: float
    resumed_step: int | None
    """The step the attempt continued after (0 fresh start); None when its start was not logged."""
    last_step: int | None
    last_time: float
    finished: bool


@dataclass(frozen=True)
class Incident:
    time: float
    attempt: int
    cause: str
    last_step: int | None
    resumed_step: int | None
    back_to_training_s: float | None
    """From the incident to the first step of the next attempt."""
    recovered_s: float | None
    """From the incident until the run passed the last step done before it (the lost work redone)."""


@dataclass(frozen=True)
class Action:
    time: float
    kind: str
    step: int | None
    rank: int | None
    node: str | None
    reason: str | None
    seconds: float | None


@dataclass(frozen=True)
class QuorumChange:
    """A live-recovery epoch (``live_quorum``, docs/live_recovery.md) and what it cost."""

    time: float
    epoch: int
    step: int | None  # its first step (None: a join the survivors had not placed yet)
    members: list[int]
    left: list[int]
    joining: list[int]
    reason: str
    survivors_lost_s: float | None
    """Shrink: the longest a survivor went without committing a step across the change (its last step
    before this epoch to its first after: detection, agreement and the new group included); join: their
    pause for the transfer."""
    rejoin_s: float | None
    """Join: from the epoch that left the joiners out to the last of them stepping again."""


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    step: int | None
    time: float | None
    phase: str | None


@dataclass
class RunFacts:
    run_dir: Path
    now: float
    steps: list[StepPoint] = field(default_factory=list)
    skips: list[SkipMark] = field(default_factory=list)
    detections: list[Detection] = field(default_factory=list)
    checkpoints: list[CheckpointFact] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    quorum_changes: list[QuorumChange] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    skip_threshold: float | None = None
    """The fixed data-skip threshold of the run's configuration (None: guard off or adaptive)."""
    finish_reason: str | None = None
    stop_reason: str | None = None
    """Why the last attempt stopped without finishing, when an event says so."""
    first_time: float | None = None
    last_event_time: float | None = None
    notes: list[str] = field(default_factory=list)
    """Inputs that could not be read, named, so a reader knows what the summary lacks."""

    @property
    def last_step(self) -> StepPoint | None:
        return self.steps[-1] if self.steps else None

    @property
    def last_checkpoint(self) -> CheckpointFact | None:
        kept = [c for c in self.checkpoints if c.deleted is None]
        return max(kept, key=lambda c: (c.step, c.time or 0.0)) if kept else None

    @property
    def restarts(self) -> int:
        logged = sum(1 for a in self.actions if a.kind == "restart")
        return max(len(self.attempts) - 1, logged, 0)

    @property
    def excluded_nodes(self) -> list[str]:
        nodes = [a.node or (f"rank {a.rank}" if a.rank is not None else "?") for a in self.actions
                 if a.kind == "node_excluded"]
        return list(dict.fromkeys(nodes))

    @property
    def last_heartbeat(self) -> float | None:
        times = [h.time for h in self.heartbeats if h.time is not None]
        return max(times) if times else None

    @property
    def state(self) -> str:
        """``finished``, ``live`` (heard from recently), ``stopped: <why>`` or ``no events``."""
        if self.finish_reason is not None:
            return "finished"
        if self.stop_reason is not None and self.stop_reason.startswith("stopped on purpose"):
            return self.stop_reason  # the run said it ended (kill switch, signal, time limit): not live
        latest = max((t for t in (self.last_heartbeat, self.last_event_time) if t is not None), default=None)
        if latest is None:
            return "no events"
        if self.now - latest < LIVE_SECONDS:
            return "live"
        return f"stopped: {self.stop_reason}" if self.stop_reason else "stopped (no run_finished event)"


def number(value: Any) -> float | None:
    """A float from a JSON field: numbers, and the strings ``"nan"``/``"inf"`` the event log writes."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _time(event: dict) -> float | None:
    return number(event.get("time", event.get("ts")))


def _seconds(event: dict) -> float | None:
    for key in ("recover_seconds", "seconds", "duration_s"):
        value = number(event.get(key))
        if value is not None:
            return value
    return None


def read_run(run_dir: str | Path, now: float | None = None) -> RunFacts:
    """Everything ``report`` and ``status`` show; ConfigError (exit 2) when ``run_dir`` is no run directory."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ConfigError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a directory")
    events_path = run_dir / EVENTS_FILE
    if not events_path.exists() and not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir}: not a run directory (no {EVENTS_FILE} or checkpoints/ in it)")
    facts = RunFacts(run_dir=run_dir, now=time.time() if now is None else now)
    events = _read_events(events_path, facts)
    _from_events(events, facts)
    _from_checkpoints(run_dir / "checkpoints", facts)
    facts.heartbeats = _read_heartbeats(run_dir / HEARTBEAT_DIR, facts)
    return facts


def _read_events(path: Path, facts: RunFacts) -> list[dict]:
    if not path.exists():
        facts.notes.append(f"{path}: missing")
        return []
    try:
        events = [e for e in read_events(path) if isinstance(e, dict) and _time(e) is not None]
    except (OSError, UnicodeDecodeError) as exc:
        facts.notes.append(f"{path}: unreadable ({exc})")
        return []
    # Ranks append concurrently: order by time so attempts split cleanly (stable for equal times).
    events.sort(key=_time)
    return events


def _from_events(events: list[dict], facts: RunFacts) -> None:
    if not events:
        return
    facts.first_time = _time(events[0])
    facts.last_event_time = _time(events[-1])
    attempt_events = _split_attempts(events)
    verdicts: dict[tuple[int, int | None], str] = {}  # (step, rank or None for every rank) -> rerun verdict
    saved: dict[int, float] = {}  # step -> time of its latest checkpoint_saved
    for index, chunk in enumerate(attempt_events):
        for event in chunk:
            _one_event(event, index, facts, verdicts, saved)
    facts.detections = [
        Detection(d.step, d.time, d.rank, d.point, d.level, d.value, d.rule, d.device,
                  verdicts.get((d.step, d.rank), verdicts.get((d.step, None))))
        if d.step is not None else d
        for d in facts.detections
    ]
    blocked = {_int(e.get("step")): number(e.get("blocked_s")) for e in events if e.get("kind") == "checkpoint_saved"}
    for ckpt in facts.checkpoints:
        if ckpt.tier == "durable":
            ckpt.blocked_s = blocked.get(ckpt.step)
    facts.attempts = [_attempt(index, chunk) for index, chunk in enumerate(attempt_events)]
    facts.incidents = _incidents(facts.attempts, attempt_events, facts.steps)
    facts.quorum_changes = _quorum_changes(events)
    if facts.attempts and not facts.attempts[-1].finished:
        facts.stop_reason = _cause(attempt_events[-1])
    _live_progress(events, facts)


def _live_progress(events: list[dict], facts: RunFacts) -> None:
    """A live-recovery run writes ``live_step`` (each rank, each committed step) and ``live_done`` (each
    rank at its end) instead of ``step`` and ``run_finished``: its steps, one point per step the run
    committed (numbered as ``step`` events are, the count of steps done), and finished once every rank of
    its first epoch is done."""
    committed: dict[int, float] = {}
    stands: dict[int, dict] = {}  # each step's last live_step: a step undone after a peer's failure and redone
    for event in events:
        step, t = _int(event.get("step")), _time(event)
        if event.get("kind") == "live_step" and step is not None and t is not None:
            committed.setdefault(step + 1, t)
            stands[step + 1] = event
    if not facts.steps:
        facts.steps = [StepPoint(step, t, number(stands[step].get("loss")), number(stands[step].get("global_norm")),
                                 bool(stands[step].get("skipped")), 0) for step, t in sorted(committed.items())]
    first = next((e for e in events if e.get("kind") == "live_quorum"), None)
    world = set(first.get("members") or []) if first is not None else set()
    done = {_int(e.get("rank")) for e in events if e.get("kind") == "live_done"}
    if world and world <= done and facts.finish_reason is None:
        facts.finish_reason = "finished"


def _quorum_changes(events: list[dict]) -> list[QuorumChange]:
    def of_epoch(kind: str, epoch: int) -> list[dict]:
        return [e for e in events if e.get("kind") == kind and e.get("epoch") == epoch]

    changes: list[QuorumChange] = []
    left_at: dict[int, float] = {}  # rank -> when an epoch left it out
    for event in (e for e in events if e.get("kind") == "live_quorum"):
        epoch, t = _int(event.get("epoch")), _time(event)
        left, joining = list(event.get("left") or []), list(event.get("joining") or [])
        for rank in left:
            left_at[rank] = t
        lost, rejoin = None, None
        if left:
            lost = _longest_without_a_step(events, list(event.get("members") or []), t)
        if joining:
            lost = max((number(e.get("paused_s")) or 0.0 for e in of_epoch("live_switch", epoch)), default=None)
            joined = [_time(e) for e in of_epoch("live_joined", epoch)]
            since = [left_at[r] for r in joining if r in left_at]
            rejoin = max(joined) - min(since) if joined and since else None
        step = _int(event.get("step"))
        if step is None:  # a join: the survivors placed it at the step boundary they switched at
            step = next((_int(e.get("step")) for e in of_epoch("live_switch", epoch)), None)
        changes.append(QuorumChange(t, epoch, step, list(event.get("members") or []), left,
                                    joining, str(event.get("reason", "")), lost, rejoin))
    return changes


def _longest_without_a_step(events: list[dict], ranks: list[int], at: float | None) -> float | None:
    """The longest any of ``ranks`` went from its last ``live_step`` before ``at`` to its first after."""
    gaps = []
    for rank in ranks:
        times = [_time(e) for e in events if e.get("kind") == "live_step" and e.get("rank") == rank]
        before = [t for t in times if t is not None and at is not None and t <= at]
        after = [t for t in times if t is not None and at is not None and t > at]
        if before and after:
            gaps.append(min(after) - max(before))
    return max(gaps, default=None)


def _split_attempts(events: list[dict]) -> list[list[dict]]:
    """Events grouped by start of the run: each ``run_started`` (rank 0, once per launch) opens an attempt."""
    chunks: list[list[dict]] = [[]]
    for event in events:
        if event.get("kind") == "run_started" and any(e.get("kind") == "run_started" for e in chunks[-1]):
            chunks.append([])
        chunks[-1].append(event)
    return chunks


def _one_event(event: dict, attempt: int, facts: RunFacts, verdicts: dict[tuple[int, int | None], str],
               saved: dict[int, float]) -> None:
    kind = event.get("kind")
    t = _time(event)
    step = _int(event.get("step"))
    if kind == "step" and step is not None:
        facts.steps.append(StepPoint(step, t, number(event.get("loss")), number(event.get("global_norm")),
                                     bool(event.get("skipped")), attempt))
    elif kind in ("data_skip", "data_skip_abort") and step is not None:
        if kind == "data_skip_abort" and any(s.step == step and s.time <= t for s in facts.skips[-1:]):
            facts.skips[-1] = SkipMark(step, facts.skips[-1].time, facts.skips[-1].global_norm,
                                       facts.skips[-1].threshold, facts.skips[-1].nan, "data_skip_abort")
            return
        norm = number(event.get("global_norm"))
        facts.skips.append(SkipMark(step, t, norm, number(event.get("threshold")),
                                    bool(event.get("nan")) or (norm is not None and not math.isfinite(norm)), kind))
    elif kind == "sdc_detected":
        facts.detections.append(Detection(
            step, t, _int(event.get("rank")), str(event.get("point", "?")), _int(event.get("level")),
            number(event.get("value")), str(event.get("rule", "")), str(event.get("device", "")), None))
    elif kind == "sdc_rerun" and step is not None:
        verdict = str(event.get("verdict"))
        by_rank = event.get("verdicts")
        if isinstance(by_rank, dict):  # each rank's own verdict: the strongest is one rank's, not every rank's
            for rank, label in by_rank.items():
                if str(rank).isdigit():  # JSON object keys are strings
                    verdicts[(step, int(rank))] = str(label)
        elif verdict != "none":  # a run from before per-rank verdicts: the step's verdict for every rank
            verdicts[(step, None)] = verdict
        if verdict in ("reproducible", "unverified"):
            facts.skips.append(SkipMark(step, t, None, None, False, f"sdc {verdict}"))
    elif kind in ("checkpoint_committed", "local_checkpoint_saved", "mirror_uploaded") and step is not None:
        tier = str(event.get("tier") or {"local_checkpoint_saved": "local", "mirror_uploaded": "mirror"}.get(kind, "durable"))
        path = _str(event.get("path"))
        facts.checkpoints.append(CheckpointFact(
            step, tier, t, name=Path(path).name if path else f"global_step_{step}", seconds=number(event.get("seconds")),
            size_bytes=_int(event.get("bytes"))))
    elif kind == "checkpoint_saved" and step is not None:
        saved[step] = t
    elif kind == "checkpoint_deleted" and step is not None:
        tier = str(event.get("tier") or "durable")
        reason = str(event.get("reason") or "deleted")
        for ckpt in reversed(facts.checkpoints):
            if ckpt.step == step and ckpt.tier == tier and ckpt.deleted is None:
                ckpt.deleted = reason
                break
        else:
            # Committed by a process killed before it could log the commit: placed at its save.
            facts.checkpoints.append(CheckpointFact(step, tier, saved.get(step), name=f"global_step_{step}",
                                                    deleted=reason))
    elif kind == "fault_injected":
        facts.faults.append(event)
    elif kind == "run_finished":
        facts.finish_reason = str(event.get("reason") or "finished")
    elif kind in ("run_started", "lifecycle_stop"):  # the run went on, or stopped, after an earlier finish
        facts.finish_reason = None
    if kind in ACTION_KINDS:
        # the supervisor writes its events as rank -1: a restart's rank and node are the ones that failed
        rank = event["failing_rank"] if event.get("failing_rank") is not None else event.get("rank")
        facts.actions.append(Action(t, kind, step, _int(rank), _str(event.get("node") or event.get("failing_node")),
                                    _str(event.get("reason")), _seconds(event)))


def _attempt(index: int, chunk: list[dict]) -> Attempt:
    started = next((e for e in chunk if e.get("kind") == "run_started"), None)
    steps = [e for e in chunk if e.get("kind") == "step" and _int(e.get("step")) is not None]
    return Attempt(
        index=index,
        started=_time(started or chunk[0]),
        resumed_step=_int(started.get("step")) if started else None,
        last_step=steps[-1]["step"] if steps else (_int(started.get("step")) if started else None),
        last_time=_time(chunk[-1]),
        finished=_ends_finished(chunk),
    )


def _ends_finished(chunk: list[dict]) -> bool:
    """Whether an attempt's last word is ``run_finished``: a start that found the kill switch armed
    writes its ``lifecycle_stop`` into the attempt before it (it starts nothing), after its finish."""
    ends = [e.get("kind") for e in chunk if e.get("kind") in ("run_finished", "lifecycle_stop")]
    return bool(ends) and ends[-1] == "run_finished"


def _cause(chunk: list[dict]) -> str | None:
    """What ended an attempt, from its events: a detected hang, an exclusion, an abort, a fired fault."""
    stops = [e for e in chunk if e.get("kind") == "lifecycle_stop"]
    if stops:
        stop = stops[-1]
        reason = str(stop.get('reason', '?')).replace('_', ' ')
        if stop.get("outcome") == "not_started":  # a start that found the stop already asked for
            return (f"stopped on purpose: {reason} armed at start, nothing trained (exit {stop.get('exit_code')}; "
                    f"the run is at step {stop.get('step')})")
        return f"stopped on purpose: {reason} at step {stop.get('step')} (exit {stop.get('exit_code')})"
    faulty = [e for e in chunk if e.get("kind") == "sdc_rerun" and e.get("verdict") == "faulty"]
    if faulty:
        return f"faulty hardware (SDC) at step {faulty[-1].get('step')}"
    for kind in _CAUSE_KINDS:
        found = [e for e in chunk if e.get("kind") == kind
                 and (kind != "fault_injected" or e.get("fault") in ("kill", "hang"))]
        if found:
            return _describe_cause(found[-1])
    return None


def _describe_cause(event: dict) -> str:
    kind = event.get("kind")
    where = f" at step {event['step']}" if _int(event.get("step")) is not None else ""
    rank = _int(event.get("rank"))
    who = f" on rank {rank}" if rank is not None and rank >= 0 else ""  # rank -1: the supervisor wrote it
    if kind == "hang_detected" and event.get("suspect_ranks"):  # the rank the others waited for
        who = f" on rank(s) {', '.join(map(str, event['suspect_ranks']))}"
    if kind == "fault_injected":
        return f"injected {event.get('fault')}{who}{where}"
    if kind == "node_excluded":
        return f"node {event.get('node', '?')} excluded{where}" + (f" ({event['reason']})" if event.get("reason") else "")
    if kind == "data_skip_abort":
        return f"data-skip abort{where}"
    return f"{str(kind).replace('_', ' ')}{who}{where}"


def _incidents(attempts: list[Attempt], chunks: list[list[dict]], steps: list[StepPoint]) -> list[Incident]:
    """One incident per attempt that ended without ``run_finished`` and was followed by another."""
    incidents = []
    for attempt, chunk, following in zip(attempts, chunks, attempts[1:]):
        if attempt.finished:
            continue
        cause_events = [e for e in chunk if e.get("kind") in _CAUSE_KINDS + ("sdc_rerun",)
                        and (e.get("kind") != "fault_injected" or e.get("fault") in ("kill", "hang"))
                        and (e.get("kind") != "sdc_rerun" or e.get("verdict") == "faulty")]
        at = _time(cause_events[-1]) if cause_events else attempt.last_time
        later = [s for s in steps if s.attempt > attempt.index]
        first = later[0].time if later else None
        target = attempt.last_step
        regained = next((s.time for s in later if target is None or s.step > target), None)
        incidents.append(Incident(
            time=at,
            attempt=attempt.index,
            cause=_cause(chunk) or "stopped without an event (crash or external kill)",
            last_step=attempt.last_step,
            resumed_step=following.resumed_step,
            back_to_training_s=None if first is None else first - at,
            recovered_s=None if regained is None else regained - at,
        ))
    return incidents


def _from_checkpoints(root: Path, facts: RunFacts) -> None:
    """Adds what is on disk to the event history: presence, health, size; and checkpoints no event named."""
    if not root.is_dir():
        return
    try:
        records = {r["ckpt_name"]: r for r in read_health_records(root / HEALTH_FILE)}
    except CheckpointError as exc:
        facts.notes.append(str(exc))
        records = {}
    for ckpt in facts.checkpoints:
        if ckpt.tier == "durable" and ckpt.name in records:
            ckpt.health = "unhealthy" if marked_unhealthy(records[ckpt.name]) else "healthy"
    try:
        on_disk = list_checkpoints(root)
    except OSError as exc:
        facts.notes.append(f"{root}: unreadable ({exc})")
        return
    for info in on_disk:
        if not info.committed:
            continue
        manifest = info.manifest
        logged = [c for c in facts.checkpoints if c.tier == "durable" and c.name == info.name and c.deleted is None]
        ckpt = logged[-1] if logged else None
        if ckpt is None:
            ckpt = CheckpointFact(info.step, "durable", manifest.created, name=info.name)
            facts.checkpoints.append(ckpt)
        ckpt.present = True
        ckpt.size_bytes = manifest.total_size
        if manifest.health is not None:
            ckpt.health = "unhealthy" if marked_unhealthy(manifest.health) else "healthy"
        elif info.name in records:
            ckpt.health = "unhealthy" if marked_unhealthy(records[info.name]) else "healthy"
        config = manifest.trainer_state.get("config") if isinstance(manifest.trainer_state, dict) else None
        facts.skip_threshold = _fixed_skip_threshold(config) if facts.skip_threshold is None else facts.skip_threshold
    facts.checkpoints.sort(key=lambda c: (c.time or 0.0, c.step))


def _fixed_skip_threshold(config: Any) -> float | None:
    try:
        skip = config["guards"]["skip"]
    except (KeyError, TypeError):
        return None
    if not isinstance(skip, dict) or not skip.get("enabled") or skip.get("mode", "absolute") != "absolute":
        return None
    return number(skip.get("threshold"))


def _read_heartbeats(directory: Path, facts: RunFacts) -> list[Heartbeat]:
    beats = []
    if not directory.is_dir():
        return beats
    for path in sorted(directory.glob("rank_*.json")):
        suffix = path.stem.removeprefix("rank_")
        if not suffix.isdigit():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            # A heartbeat is rewritten constantly; a torn read is normal on a live run, so only noted.
            facts.notes.append(f"{path}: unreadable ({exc.__class__.__name__})")
            continue
        if not isinstance(data, dict):
            facts.notes.append(f"{path}: expected a JSON object")
            continue
        beats.append(Heartbeat(int(suffix), _int(data.get("step")), _time(data), _str(data.get("phase"))))
    return sorted(beats, key=lambda h: h.rank)
