"""Errors that end a command with a documented exit code and one clear line."""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USAGE = 2
EXIT_DATA_SKIP_ABORT = 3
EXIT_NO_CHECKPOINT = 4
EXIT_RESUMABLE_STOP = 16
EXIT_FAULTY_HARDWARE = 17
# a live step that raised the same way fault_tolerance.max_step_failures times in a row (live/step_failures.py)
EXIT_STEP_FAILED = 19
EXIT_CLOSED_STDOUT = 141  # the reader of stdout left: the shell's code for a writer ended by SIGPIPE (128 + 13)


class TrainguardError(Exception):
    """An expected failure: printed as one line, mapped to ``exit_code``."""

    exit_code = EXIT_CRASH
    every_rank_raises = False
    """Set (by ``raised_by_every_rank``) when all ranks of a run raise this failure alike: rank 0 alone
    reports it, the others stay quiet."""


def raised_by_every_rank(exc: TrainguardError) -> TrainguardError:
    exc.every_rank_raises = True
    return exc


def failure_of_rank(rank: int, message: str, exit_code: int) -> TrainguardError:
    """What every rank raises after learning that ``rank`` failed with ``message``."""
    exc = TrainguardError(f"{message} (rank {rank})")
    exc.exit_code = exit_code
    return raised_by_every_rank(exc)


class ConfigError(TrainguardError):
    """Bad configuration, option or input file (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigErrorExit(ConfigError, SystemExit):
    """A ``ConfigError`` whose line is already printed: left uncaught it ends the process quietly with
    exit 2 (a ``SystemExit``), caught as a ``ConfigError`` it is one (a library call in a notebook)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = EXIT_USAGE


class CheckpointError(TrainguardError):
    """A checkpoint that cannot be read, verified or trusted."""

    exit_code = EXIT_CRASH


class RestoreFailed(CheckpointError):
    """A checkpoint chosen for a restore (a rollback's, a recompute's) that verified but failed to load:
    ``error``'s line, kept with its ``every_rank_raises``; ``step``: the checkpoint's."""

    def __init__(self, step: int, error: TrainguardError):
        super().__init__(str(error))
        self.step = step
        self.every_rank_raises = error.every_rank_raises


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code when loaded; refused, never executed."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint file written under another torch version that this torch cannot rebuild (it names a
    class this torch lacks)."""


class NoCheckpointError(TrainguardError):
    """Resume was asked for but no usable checkpoint exists (exit 4)."""

    exit_code = EXIT_NO_CHECKPOINT
