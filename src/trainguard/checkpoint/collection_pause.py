"""Automatic garbage collection paused while a save plans and writes.

A durable save's planning (DCP's plans, their pickled exchange, the metadata) makes tens of thousands
of short-lived objects in the training process. The young collections that run meanwhile promote the
ones still alive to the oldest generation, and once enough have been promoted the next collection is a
full one: it scans every object of the process (torch's and transformers' included), 190–250 ms with
the GIL held, which stalls the training thread (``benchmarks/gc_stall.py``: none in 160 steps without
saves, one every 8 durable saves with them). With automatic collection paused for the save, those
objects are freed by their reference counts without ever being promoted.

The pause is process-wide (the collector has one switch): while it lasts, cyclic garbage of the
training thread waits too, until the save is done. Pauses nest across threads; the collector is turned
back on only by the last one to end, and only if it was on when the first began (a loop that runs with
automatic collection off, collecting by hand, keeps it off). Code that turns automatic collection off
or on while a save runs finds it, when the save ends, as it was before the save began. A process
forked during a pause (a data loader's worker) starts with automatic collection as it was before the
pause.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pauses:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False  # whether automatic collection was on when the first pause began

    def begin(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.depth += 1

    def end(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.was_enabled:
                gc.enable()

    def forked(self) -> None:
        """In a child forked during a pause: none of the parent's pauses runs here."""
        if self.depth and self.was_enabled:
            gc.enable()
        self.depth = 0
        self.lock = threading.Lock()  # another thread of the parent may have held it at the fork


_PAUSES = _Pauses()
os.register_at_fork(after_in_child=_PAUSES.forked)


@contextmanager
def collections_paused() -> Iterator[None]:
    """Automatic garbage collection off while the block runs (see the module's doc)."""
    _PAUSES.begin()
    try:
        yield
    finally:
        _PAUSES.end()
