"""One long-lived thread per saver that runs the background part of its saves, one after the other.

``threading.Thread.start`` returns only once the new thread runs, so a save that started a thread of
its own blocked the loop until the scheduler ran it: on the 2 busy cores of the benchmark machine this
was a large part of what a lazy save still blocks for (``benchmarks/nostall.py --only blocked``). A
saver keeps one thread instead, started at its first save, and hands it each save's work through a
queue. It is a daemon thread, as the per-save threads were (a process that exits does not wait for a
save stuck in a collective), and it ends once its saver is gone.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_STOP = None


class BackgroundWorker:
    def __init__(self, name: str):
        """``name``: the thread's name."""
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._jobs.put, _STOP)

    def run(self, function: Callable[..., Any], *args: Any) -> threading.Event:
        """Queues ``function(*args)`` (which keeps its own errors) and returns at once; the event is set
        once it has run."""
        if self._thread is None or not self._thread.is_alive():  # the first save, or after a fork
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), daemon=True, name=self.name)
            self._thread.start()
        done = threading.Event()
        self._jobs.put((function, args, done))
        return done


def _serve(jobs: queue.SimpleQueue) -> None:
    """Runs jobs until the worker is gone (it holds no reference to the worker, only to its queue)."""
    while (job := jobs.get()) is not _STOP:
        function, args, done = job
        try:
            function(*args)
        finally:
            done.set()
            del job, function, args  # nothing of a finished save is kept alive while the thread waits
