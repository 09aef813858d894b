"""Stopping a training process on purpose: kill switch, time limit, SIGTERM/SIGUSR1.

Before every step each rank computes a local stop reason (a file exists, the deadline is near, a
signal arrived) and the ranks agree on the strongest one with one all-reduce of a single integer,
so every rank stops after the same step. The trainer then saves that step and exits:

- kill switch (the reference's ``--kill-switch-path``): exit 0; found at start: exit 0 at once;
- a signal (SIGTERM, or SIGUSR1 as Slurm's ``--signal=USR1@90`` sends it): exit 16 (resumable);
  a second signal exits at once (16: the newest committed checkpoint is the resume point);
- ``exit_duration_in_mins`` (the reference's ``--exit-duration-in-mins``): exit 16 while there is
  still time for one more step and the save, measured on this run's own steps and saves.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.errors import EXIT_OK, EXIT_RESUMABLE_STOP, ConfigError
from trainguard.runtime.hang import register_stack_dump
from trainguard.runtime.heartbeat import HeartbeatWriter, incarnation

ENV_JOB_START = "TRAINGUARD_JOB_START"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# stop reasons, ordered: the all-reduce keeps the largest
NONE, DEADLINE, SIGNAL, KILL_SWITCH = 0, 1, 2, 3
REASON_NAMES = {DEADLINE: "exit_duration", SIGNAL: "signal", KILL_SWITCH: "kill_switch"}
EXIT_CODES = {DEADLINE: EXIT_RESUMABLE_STOP, SIGNAL: EXIT_RESUMABLE_STOP, KILL_SWITCH: EXIT_OK}


@dataclass
class LifecycleConfig:
    kill_switch_path: str | None = None  # stop (save, exit 0) when this path exists
    exit_duration_in_mins: float | None = None  # save and exit 16 before this many minutes since the job started
    exit_margin_seconds: float = 0.0  # extra time kept free before that limit, on top of one step and one save
    heartbeats: bool = True  # write RUN_DIR/heartbeats/rank_R.json (the supervisor's hang detection needs them)

    def validate(self, source: str) -> None:
        limit = self.exit_duration_in_mins
        if limit is not None and not (math.isfinite(limit) and limit > 0):
            raise ConfigError(f"{source}: config key 'lifecycle.exit_duration_in_mins' must be > 0, got {limit!r}")
        if not (math.isfinite(self.exit_margin_seconds) and self.exit_margin_seconds >= 0):
            raise ConfigError(f"{source}: config key 'lifecycle.exit_margin_seconds' must be ≥ 0, "
                              f"got {self.exit_margin_seconds!r}")
        if self.kill_switch_path is not None and not str(self.kill_switch_path).strip():
            raise ConfigError(f"{source}: config key 'lifecycle.kill_switch_path' must not be empty")


def job_start_time() -> float:
    """When the time limit started counting: the supervisor's start, Slurm's job start, or now."""
    for name in (ENV_JOB_START, "SLURM_JOB_START_TIME"):
        value = os.environ.get(name)
        if value:
            try:
                return float(value)
            except ValueError:
                pass
    return time.time()


def deadline_near(now: float, deadline: float, step_seconds: float, save_seconds: float, margin: float) -> bool:
    """True when one more step followed by a save would not end before the deadline."""
    return now + step_seconds + save_seconds + margin >= deadline


class StopSignals:
    """SIGTERM/SIGUSR1 handlers: the first sets a flag, the second (2 s or more later) ends the process at once."""

    def __init__(self, on_second=None):
        self.received: str | None = None
        self._first_at = 0.0
        self._on_second = on_second
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    # the same stop can arrive twice at once (Slurm signals the whole step, the supervisor forwards it)
    DUPLICATE_WITHIN_SECONDS = 2.0

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = name, now
            return
        if now - self._first_at < self.DUPLICATE_WITHIN_SECONDS:
            return
        print(f"trainguard: second stop signal ({name}) after {self.received}: exiting at once",
              file=sys.stderr, flush=True)
        if self._on_second is not None:
            self._on_second()
        os._exit(EXIT_RESUMABLE_STOP)


class Lifecycle:
    """The per-step stop decision of one rank; ``decide`` must be called by every rank together."""

    def __init__(self, config: LifecycleConfig, all_reduce_max=None, heartbeat: HeartbeatWriter | None = None):
        self.config = config
        self.heartbeat = heartbeat
        self.kill_switch = Path(config.kill_switch_path) if config.kill_switch_path else None
        self.deadline = (job_start_time() + config.exit_duration_in_mins * 60.0
                         if config.exit_duration_in_mins else None)
        self.signals = StopSignals(on_second=lambda: self.beat("exit", self._step, EXIT_RESUMABLE_STOP))
        self._step = 0
        self._all_reduce_max = all_reduce_max
        self.longest_step = 0.0
        self.longest_save = 0.0

    @classmethod
    def for_rank(cls, config: LifecycleConfig, run_dir: Path, rank: int, device) -> "Lifecycle":
        """The trainer's lifecycle: heartbeats, stack dumps on SIGUSR2, stop signals, the all-reduce."""
        lifecycle = cls(config, all_reduce_max_fn(device))
        # the stop handlers first: the supervisor sends a stop to the pid of the first heartbeat at once
        lifecycle.heartbeat = HeartbeatWriter(run_dir, rank) if config.heartbeats else None
        lifecycle._dump_file = register_stack_dump(run_dir, rank, incarnation())
        return lifecycle

    def beat(self, phase: str, step: int, exit_code: int | None = None) -> None:
        self._step = step
        if self.heartbeat is not None:
            self.heartbeat.beat(phase, step, exit_code)

    def note_step(self, seconds: float) -> None:
        self.longest_step = max(self.longest_step, seconds)

    def note_save(self, seconds: float) -> None:
        self.longest_save = max(self.longest_save, seconds)

    def local_reason(self, now: float | None = None) -> int:
        if self.kill_switch is not None and self.kill_switch.exists():
            return KILL_SWITCH
        if self.signals.received is not None:
            return SIGNAL
        if self.deadline is not None:
            now = time.time() if now is None else now
            if deadline_near(now, self.deadline, self.longest_step, self.longest_save, self.config.exit_margin_seconds):
                return DEADLINE
        return NONE

    def decide(self) -> int:
        """The stop reason every rank agrees on (the strongest of theirs), or ``NONE``."""
        reason = self.local_reason()
        if self._all_reduce_max is not None:
            reason = self._all_reduce_max(reason)
        return reason

    def describe(self, reason: int) -> str:
        if reason == KILL_SWITCH:
            return f"kill switch {self.kill_switch} exists"
        if reason == SIGNAL:
            return f"received {self.signals.received or 'a stop signal'}"
        limit = self.config.exit_duration_in_mins
        return f"exit duration of {limit:g} min is near (one step and a save must fit)"


def all_reduce_max_fn(device):
    """One all-reduce of one integer over the default process group."""
    import torch
    import torch.distributed as dist

    def reduce(value: int) -> int:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    return reduce
