"""Hang detection: the timeout policy, and Python stack dumps of every rank when a run stops moving.

Every rank registers ``faulthandler`` on SIGUSR2, writing to ``RUN_DIR/hangs/incarnation_K/rank_R.txt``.
faulthandler dumps from its C signal handler, so a rank stuck in a collective or a sleep still
answers. The supervisor sends SIGUSR2 to every rank it knows from the heartbeats, waits a moment for
the dumps, then kills the whole group.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from trainguard.runtime.heartbeat import Heartbeat

DUMP_SIGNAL = signal.SIGUSR2
HANGS_DIR = "hangs"


def dump_dir(run_dir: str | os.PathLike, incarnation: int) -> Path:
    return Path(run_dir) / HANGS_DIR / f"incarnation_{incarnation}"


def register_stack_dump(run_dir: str | os.PathLike, rank: int, incarnation: int):
    """Arms SIGUSR2 to dump this process's Python stacks; returns the open file (keep it alive)."""
    directory = dump_dir(run_dir, incarnation)
    directory.mkdir(parents=True, exist_ok=True)
    dump = open(directory / f"rank_{rank}.txt", "a")
    faulthandler.register(DUMP_SIGNAL, file=dump, all_threads=True, chain=False)
    return dump


def remove_empty_dumps(run_dir: str | os.PathLike, incarnation: int) -> None:
    """Drops the dump files of ranks that were never asked to dump (and the directory if it is empty)."""
    directory = dump_dir(run_dir, incarnation)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.is_file() and path.stat().st_size == 0:
            path.unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        pass


@dataclass(frozen=True)
class HangPolicy:
    """No progress for ``timeout`` seconds is a hang.

    ``fixed`` (``--hang-timeout S``) wins; otherwise ``multiple`` × the longest gap between two
    progress heartbeats seen so far (a step, or a step and a save), never below ``floor``. Before the
    first step of an incarnation (imports, model build, checkpoint load) ``startup`` applies.
    """

    fixed: float | None = None
    multiple: float = 10.0
    floor: float = 60.0
    startup: float = 600.0

    def timeout(self, longest_gap: float, started_training: bool) -> float:
        if self.fixed is not None:
            return self.fixed if started_training else max(self.fixed, self.startup)
        if not started_training:
            return self.startup
        return max(self.floor, self.multiple * longest_gap)


# phases in which a rank works alone; the others, once done with their step, wait for it in a collective
LOCAL_PHASES = ("init", "resume", "save")
COLLECTIVE_FRAMES = "torch/distributed/"


def suspects_from_heartbeats(beats: dict[int, Heartbeat]) -> list[int]:
    """Ranks the others wait for, from the heartbeats alone: behind in steps, or stuck in a local phase.

    Empty when the heartbeats are level (every rank beat the same step, e.g. one rank stuck inside the
    next step's computation while the others wait in its all-reduce): the stack dumps decide then.
    """
    if len(beats) < 2:
        return []
    newest = max(beat.step for beat in beats.values())
    behind = sorted(rank for rank, beat in beats.items() if beat.step < newest)
    if behind:
        return behind
    local = sorted(rank for rank, beat in beats.items() if beat.phase in LOCAL_PHASES)
    return local if len(local) < len(beats) else []


def main_thread_top(dump: str, frames: int = 3) -> str:
    """The innermost frames of the main thread (faulthandler lists threads newest first: it is the last)."""
    blocks = [block for block in dump.split("\n\n") if "File " in block]
    if not blocks:
        return ""
    lines = [line for line in blocks[-1].splitlines() if line.strip().startswith("File ")]
    return "\n".join(lines[:frames])


def suspects_from_dumps(dumps: dict[int, str]) -> list[int]:
    """Ranks whose main thread is not inside torch.distributed, when the others wait in a collective."""
    tops = {rank: main_thread_top(text) for rank, text in dumps.items()}
    tops = {rank: top for rank, top in tops.items() if top}
    waiting = {rank for rank, top in tops.items() if COLLECTIVE_FRAMES in top}
    if not waiting or len(waiting) == len(tops):
        return []
    return sorted(set(tops) - waiting)


def suspect_ranks(beats: dict[int, Heartbeat], dumps: dict[int, str]) -> list[int]:
    """The hanging ranks: from the heartbeats, else from the stack dumps (any script, any launcher)."""
    return suspects_from_heartbeats(beats) or suspects_from_dumps(dumps)
