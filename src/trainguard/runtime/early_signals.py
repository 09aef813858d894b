"""SIGTERM and SIGUSR1 held from the first instant of a command that supervises a run.

``trainguard run`` and ``trainguard train`` spend their first seconds importing torch and checking the
configuration before the supervisor (or the live path) installs its own handler; a scheduler's SIGTERM
then took the default action: exit 143, no line, no event. ``__main__`` holds these signals from the
start instead (``hold``), and whoever takes over asks for what was held (``release``): the supervisor
then ends with its stop before anything started (exit 16), as it does for a signal received later.
A supervised agent (``trainguard train`` started by a supervisor) is not held: its supervisor stops it.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

from trainguard.runtime.nodes import ENV_SUPERVISED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SUPERVISING_COMMANDS = ("run", "train")

_held: list[signal.Signals] = []


def supervises(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether ``trainguard ARGV`` is a command that supervises a run (not an agent of one)."""
    return bool(argv) and argv[0] in SUPERVISING_COMMANDS and not environ.get(ENV_SUPERVISED)


def hold() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _remember)


def _remember(signum: int, frame: object) -> None:
    _held.append(signal.Signals(signum))


def release() -> list[signal.Signals]:
    """The stop signals held so far, oldest first (none when nothing was held); where the holder is still
    installed, the default action is back for the code that installs its own handler next."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _remember:
            signal.signal(sig, signal.SIG_DFL)
    taken = list(_held)
    _held.clear()
    return taken
