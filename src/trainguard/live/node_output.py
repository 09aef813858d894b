"""The standard error of the processes the live launcher starts on other nodes (behind
``LiveRun.node_command``): each written to a file of its own, relayed to the launcher's standard error as
it grows, its last line kept for the launcher's own line when the node command itself failed (an ``ssh``
that could not connect, a network namespace that does not exist: ``live_node_lost``).

A file, not a pipe: a rank writing to a pipe whose reader (the launcher) died gets ``EPIPE``, and its
own line and exit code at the launcher's death (``STORE_LOST_EXIT``, ``live.lifeline``) would become a
``BrokenPipeError``; a file outlives its reader. torchelastic relays its ranks' log files the same way
(``TailLog``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

RELAY_S = 0.1  # how often the files are read for new bytes
TAIL_BYTES = 4096  # what is kept of each file's end, for its last line


class NodeOutput:
    """The node processes' standard error files under ``directory`` and the thread that relays them."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.readers: dict[int, BinaryIO] = {}  # pid of the node command -> its file, read from where relayed
        self.tails: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, label: str, popen: Callable[[BinaryIO], subprocess.Popen]) -> subprocess.Popen:
        """The process ``popen`` starts with a new file as its standard error (``label`` in its name)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, prefix=f"{label}-", suffix=".stderr",
                                         delete=False) as writer:
            proc = popen(writer)  # the child holds its own copy of the descriptor from here
        with self.lock:
            self.readers[proc.pid] = open(writer.name, "rb")
            self.tails[proc.pid] = b""
        if self.thread is None:
            self.thread = threading.Thread(target=self._relay, name="trainguard-node-output", daemon=True)
            self.thread.start()
        return proc

    def last_line(self, pid: int) -> str:
        """The last non-empty line the node process ``pid`` wrote to its standard error so far ('' if none)."""
        self.drain()
        with self.lock:
            lines = [line.strip() for line in self.tails.get(pid, b"").decode(errors="replace").splitlines()]
        return next((line for line in reversed(lines) if line), "")

    def drain(self) -> None:
        """Relays what every file gained since the last look."""
        with self.lock:
            for pid, reader in self.readers.items():
                data = reader.read()
                if data:
                    self.tails[pid] = (self.tails[pid] + data)[-TAIL_BYTES:]
                    sys.stderr.write(data.decode(errors="replace"))
            sys.stderr.flush()

    def close(self) -> None:
        """Relays the rest and stops the thread (the launcher's end)."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        self.drain()
        with self.lock:
            for reader in self.readers.values():
                reader.close()
            self.readers.clear()

    def _relay(self) -> None:
        while not self.stopped.wait(RELAY_S):
            self.drain()
