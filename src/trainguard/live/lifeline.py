"""How the launcher ends a rank it started on another host (``LiveRun.node_command``), where its signals
do not reach: a SIGKILL reaches only the node command's local process (``ssh``, ``ip netns exec``,
``srun``), and a rank behind it (in a pid namespace of its own, on another machine) went on running
until it found itself fenced, or for ever for an unused spare.

Each such rank's stdin is a pipe from the launcher, carried by the node command as it carries any
program's input (``ssh`` forwards it, ``ip netns exec`` and ``srun`` pass it on), and the rank
(``--lifeline``) watches it in a thread: a ``KILL`` byte ends the process at once (``os._exit``: a rank
that is its pid namespace's first process ignores a SIGKILL it sends itself), and so does the pipe's end
(the launcher died, or the node command was killed before the byte crossed): exit ``STORE_LOST_EXIT``,
as the rank would when it found the launcher's store gone. A rank behind a cut link gets neither
until the link heals; the launcher does not use it on a rank found hung (the epoch fences that one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from trainguard.forking import ForkedProcess

KILL = b"K"
KILLED_EXIT = 128 + signal.SIGKILL  # what a shell reports for a process SIGKILLed


def hold(launcher_gone_exit: int, fd: int = 0) -> None:
    """In a rank started with ``--lifeline``: ends this process when the launcher writes ``KILL`` to ``fd``
    (``KILLED_EXIT``) or when the pipe ends (``launcher_gone_exit``)."""

    def watch() -> None:
        try:
            data = os.read(fd, 1)
        except OSError:
            data = b""
        if data == KILL:
            os._exit(KILLED_EXIT)
        print(f"live recovery: the launcher's lifeline (stdin) of rank process {os.getpid()} ended; exiting "
              f"{launcher_gone_exit}: the run restarts from its newest durable checkpoint", file=sys.stderr, flush=True)
        os._exit(launcher_gone_exit)

    threading.Thread(target=watch, name="trainguard-lifeline", daemon=True).start()


def kill(proc: subprocess.Popen | ForkedProcess) -> None:
    """In the launcher: ends the rank ``proc`` runs, through its lifeline when it has one (a node
    command's), and ``proc`` itself with SIGKILL."""
    lifeline = getattr(proc, "stdin", None)
    if lifeline is not None and not lifeline.closed:
        with contextlib.suppress(OSError):  # the node command has ended: its rank too, or it is out of reach
            lifeline.write(KILL)
            lifeline.flush()
        with contextlib.suppress(OSError):
            lifeline.close()
    proc.kill()
