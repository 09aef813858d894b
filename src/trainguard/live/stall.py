"""A step's all-reduce that does not finish while every member is alive: a partial cut.

A rank cut off from its peers but not from the launcher's store (gloo's ports blocked between
nodes, or a rank alive that never calls into the collective) keeps beating, so the heartbeat timeout
does not see it, and no collective fails until gloo's own timeout (``collective_timeout_s``, 30 s by
default). So each rank marks in the store when it enters and when it leaves each step's all-reduce
(``reduce/<rank>`` = ``"<epoch> <step> in|out"``, :class:`ReduceMarks`), and the lighthouse
(:class:`StallWatch`, in the launcher) judges from the marks, on its own clock:

- the all-reduce of step ``t`` is *stalled* when some member has entered it, none has left it, and
  the first entry is older than the stall bound ``max(stall_s, stall_steps × the median step time so
  far)``: a bound tied to the run's own pace (a survivor computing twice the micro-batches, a loaded
  machine's slow step stay well inside ``stall_steps`` = 10 medians), with a floor for the first steps
  and for runs whose steps take milliseconds (the lighthouse's own scheduling delays). The first step
  an epoch's members take is not judged: a new process's first backward (torch loads parts of itself
  then: 5 s measured on a loaded machine, docs/live_recovery.md's warm spares) and gloo's first exchanges on the
  epoch's new group are not a cut; a cut there waits for gloo's timeout;
- whom to exclude (:func:`excluded_groups`): the replica groups of the members that never entered
  (alive, beating, not taking part: from the others' side, exactly a peer behind a cut). When every
  member entered and none left, the marks cannot tell which side of the cut is at fault: the
  lighthouse asks every member to probe the others over a side channel (``live/probe.py``) and keeps
  the most replica groups that all reach each other. Never every group: where that would be the
  verdict, nothing is decided here and gloo's timeout stays the bound.

A durable save (``live/durable.py``: the group's exchange, DCP's collectives on the checkpoint group, the
wait for an async save's commit) is marked the same way (``"<epoch> <N> saving|saved"`` for the save of
step ``N``, ordered after the all-reduce that committed step ``N`` and before the next one) and judged at
the same bound, with one difference: a save may be slow on its own (a large model's files), so it is a
stall only when some member is absent from it or silent in it (stopped, hung: its beats stopped for half
the stall floor); everyone in it and beating is a slow save, not judged, and the probes are never asked.

The drill (``LiveRun.stall_collective``: rank R at step S) makes rank R stop before its all-reduce
of step S, beating, without marking it entered, until the epoch ends; with ``LiveRun.stall_cut`` it
marks itself entered and closes its probe socket for the rest of the run (its peers cannot reach it,
as behind a cut; gloo itself is not cut, so its group can rejoin).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.live.collective import POLL_S, EpochAborted, abort_key
from trainguard.live.probe import PeerProbe
from trainguard.live.quorum import Quorum

IN, OUT = "in", "out"  # a step's collectives
SAVING, SAVED = "saving", "saved"  # a durable save
ENTERED, LEFT = (IN, SAVING), (OUT, SAVED)
STEP_TIMES = 256  # the median step time is taken over the last this many steps
# a gap between two of the launcher's looks longer than this (it was not scheduled: a loaded machine)
# judges nobody on it: it restarts the current step's clock here, every heartbeat window in the lighthouse
LOOKED_AWAY_S = 1.0


def reduce_key(rank: int) -> str:
    return f"reduce/{rank}"


def parse_mark(value: bytes) -> tuple[int, int, str] | None:
    """``(epoch, step, phase)`` of a mark ``ReduceMarks`` wrote; None for anything else."""
    parts = value.decode(errors="replace").split()
    if len(parts) != 3 or parts[2] not in (*ENTERED, *LEFT) or not all(part.isdigit() for part in parts[:2]):
        return None
    return int(parts[0]), int(parts[1]), parts[2]


class ReduceMarks:
    """A rank's side: marks its entry into and exit from each step's all-reduce; ``stall_step``: the
    drill's step at which this rank stops before it instead (once); ``cut``: the drill's probe socket
    to close there, having marked itself entered (a cut inside the collective)."""

    def __init__(self, store: dist.Store, rank: int, events: EventLog, stall_step: int | None,
                 cut: PeerProbe | None):
        self.store, self.rank, self.events, self.stall_step, self.cut = store, rank, events, stall_step, cut

    def entering(self, epoch: int, step: int, beat: Callable[[], None]) -> None:
        if step == self.stall_step:
            self.stall_step = None
            self.events.emit("live_stall_drill", step=step, epoch=epoch, cut=self.cut is not None)
            if self.cut is not None:
                self.store.set(reduce_key(self.rank), f"{epoch} {step} {IN}")
                self.cut.close()
            while not self.store.check([abort_key(epoch)]):  # alive, beating, never in the collective
                beat()
                time.sleep(POLL_S)
            raise EpochAborted(f"drill: rank {self.rank} stayed out of the all-reduce of step {step} until "
                               f"epoch {epoch} ended")
        self.store.set(reduce_key(self.rank), f"{epoch} {step} {IN}")

    def left(self, epoch: int, step: int) -> None:
        self.store.set(reduce_key(self.rank), f"{epoch} {step} {OUT}")

    def saving(self, epoch: int, step: int) -> None:
        """Entering the durable save of ``step`` (the number of committed steps)."""
        self.store.set(reduce_key(self.rank), f"{epoch} {step} {SAVING}")

    def saved(self, epoch: int, step: int) -> None:
        self.store.set(reduce_key(self.rank), f"{epoch} {step} {SAVED}")


def saving(store: dist.Store, quorum: Quorum) -> bool:
    """Whether a member of ``quorum`` is inside a durable save now (its mark ``saving``, of this epoch)."""
    marks = (store.read(reduce_key(rank)) for rank in quorum.members)
    return any(mark is not None and mark[0] == quorum.epoch and mark[2] == SAVING
               for mark in (parse_mark(value) for value in marks if value is not None))


def position(step: int, phase: str) -> tuple[int, int]:
    """Where a mark lies in the epoch's sequence of watched collectives: the save of step ``N`` comes after
    the all-reduce of step index ``N - 1`` (which committed it) and before that of index ``N``."""
    return (step, 0) if phase in (SAVING, SAVED) else (step, 1)


@dataclass(frozen=True)
class Stall:
    step: int
    waiting: list[int]  # members in the all-reduce
    absent: list[int]  # members that have not entered it
    waited_s: float
    bound_s: float
    silent: list[int]  # members in it whose beats stopped for half the stall floor (stopped, hung)
    saving: bool = False  # the stall is of the durable save of ``step``, not of its all-reduce


def excluded_groups(members: list[int], absent: list[int], group_of: Callable[[int], int]) -> list[int]:
    """The replica groups a stall with ``absent`` members excludes: theirs; none where that would be
    every group."""
    groups = {group_of(r) for r in members}
    excluded = sorted({group_of(r) for r in absent})
    return [] if len(excluded) == len(groups) else excluded


class StallWatch:
    """The lighthouse's side: the step times seen so far and the current step's all-reduce."""

    def __init__(self, store: dist.Store, stall_s: float, stall_steps: float,
                 clock: Callable[[], float] = time.monotonic, silent_s: Callable[[int], float] = lambda rank: 0.0):
        """``clock``: seconds, monotonic (a test's own clock: the verdicts depend on time alone);
        ``silent_s``: how long a rank's heartbeat has not moved."""
        self.store, self.stall_s, self.stall_steps, self.clock = store, stall_s, stall_steps, clock
        self.silent_s = silent_s
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES)
        # (epoch, position, first seen entered): the collective watched now (``position``)
        self.current: tuple[int, tuple[int, int], float] | None = None
        self.paced: tuple[int, int, float] | None = None  # (epoch, step, first seen entered) of the last all-reduce
        self.judged: tuple[int, tuple[int, int]] | None = None  # (epoch, position) already found stalled
        self.first: tuple[int, tuple[int, int]] | None = None  # (epoch, the first position its members were seen at)
        self.last_look = clock()

    def bound_s(self) -> float:
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.stall_s, self.stall_steps * median)

    def look(self, quorum: Quorum, alive: list[int]) -> Stall | None:
        """The stall of the current epoch's all-reduce among ``alive`` (the members that have not finished),
        once per step; None while it is not one."""
        now = self.clock()
        if now - self.last_look > LOOKED_AWAY_S and self.current is not None:
            # this process was not scheduled for a while: it judges nobody on that gap
            self.current = (*self.current[:2], now)
            if self.paced is not None:
                self.paced = (*self.paced[:2], now)
        self.last_look = now
        marks: dict[int, tuple[tuple[int, int], bool]] = {}  # rank: (position, entered)
        for rank in alive:
            value = self.store.read(reduce_key(rank))
            mark = parse_mark(value) if value is not None else None
            if mark is not None and mark[0] == quorum.epoch:
                marks[rank] = (position(*mark[1:]), mark[2] in ENTERED)
        if not marks:
            return None
        at = max(p for p, _ in marks.values())
        if self.first is None or self.first[0] != quorum.epoch:
            self.first = (quorum.epoch, min(p for p, _ in marks.values()))
        step, saving = at[0], at[1] == 0
        if self.current is None or self.current[:2] != (quorum.epoch, at):
            self.current = (quorum.epoch, at, now)
            if not saving:  # the step time: from one all-reduce's first entry to the next's (a save included)
                if self.paced is not None and self.paced[0] == quorum.epoch and step > self.paced[1]:
                    self.step_times.append((now - self.paced[2]) / (step - self.paced[1]))
                self.paced = (quorum.epoch, step, now)
        waiting = [r for r, mark in marks.items() if mark == (at, True)]
        if (not waiting or any(mark == (at, False) for mark in marks.values()) or at == self.first[1]
                or self.judged == (quorum.epoch, at)):
            return None
        waited, bound = now - self.current[2], self.bound_s()
        if waited <= bound:
            return None
        absent = sorted(r for r in alive if r not in waiting)
        silent = sorted(r for r in waiting if self.silent_s(r) > self.stall_s / 2)
        if saving and not absent and not silent:  # everyone in the save and beating: a slow save, looked at again
            return None
        self.judged = (quorum.epoch, at)
        return Stall(step, sorted(waiting), absent, waited, bound, silent, saving)
