"""Per-rank heartbeats: ``RUN_DIR/heartbeats/rank_R.json``, rewritten atomically at every phase change.

A heartbeat is a few hundred bytes, written to a temporary name and renamed (no fsync: it is
liveness, not data), so a reader sees the old or the new record, never a torn one. The supervisor
and ``trainguard watch`` read the directory every fraction of a second; reading it is a handful of
small reads.

Phases: ``init`` (process is up, building the model), ``resume`` (loading a checkpoint), ``train``
(resumed at ``step``, about to run the first step), ``step`` (``step`` just completed), ``save``
(saving ``step``), ``exit`` (leaving with ``exit_code``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HEARTBEAT_DIR = "heartbeats"
ENV_NODE = "TRAINGUARD_NODE"
ENV_INCARNATION = "TRAINGUARD_INCARNATION"


def node_name() -> str:
    """The node this process runs on: the supervisor's name for it (simulated nodes), else the host."""
    return os.environ.get(ENV_NODE) or socket.gethostname()


def incarnation() -> int:
    return int(os.environ.get(ENV_INCARNATION, "0") or 0)


def heartbeat_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR


@dataclass
class Heartbeat:
    rank: int
    node: str
    pid: int
    incarnation: int
    phase: str
    step: int
    time: float
    longest_gap: float  # the longest time between two progress heartbeats of this process (a step, a save)
    started: float  # when this process wrote its first heartbeat
    exit_code: int | None = None
    resumed: int | None = None  # the step this process resumed at (0: a fresh start)
    marks: dict | None = None  # when this process first entered each phase ("first_step": its first step done)


class HeartbeatWriter:
    """Rewrites this rank's heartbeat file; ``beat`` costs one small write and a rename."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.directory = heartbeat_dir(run_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"rank_{rank}.json"
        self._temp = self.directory / f".rank_{rank}.json.{os.getpid()}"
        now = time.time()
        self.record = Heartbeat(rank=rank, node=node_name(), pid=os.getpid(), incarnation=incarnation(),
                                phase="init", step=0, time=now, longest_gap=0.0, started=now, marks={"init": now})
        self._last_progress: float | None = None
        self._write()

    def beat(self, phase: str, step: int, exit_code: int | None = None) -> None:
        now = time.time()
        if phase == "step":
            if self._last_progress is not None:
                self.record.longest_gap = max(self.record.longest_gap, now - self._last_progress)
            self._last_progress = now
        elif phase == "train":
            self._last_progress = now
            self.record.resumed = step
        mark = "first_step" if phase == "step" else phase
        self.record.marks.setdefault(mark, now)
        self.record.phase, self.record.step, self.record.time = phase, step, now
        self.record.exit_code = exit_code
        self._write()

    def _write(self) -> None:
        with open(self._temp, "w") as f:
            f.write(json.dumps(asdict(self.record)))
        os.replace(self._temp, self.path)


def read_heartbeats(run_dir: str | os.PathLike) -> dict[int, Heartbeat]:
    """Every rank's newest heartbeat, by rank; files that cannot be read are left out."""
    beats: dict[int, Heartbeat] = {}
    directory = heartbeat_dir(run_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return beats
    for name in names:
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            with open(directory / name) as f:
                beat = Heartbeat(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        beats[beat.rank] = beat
    return beats
