"""One long-lived thread per saver that runs the background part of its saves, one after the other.

``threading.Thread.start`` returns only once the new thread runs, so a save that started a thread of
its own blocked the loop until the scheduler ran it: on the 2 busy cores of the benchmark machine this
was a large part of what a lazy save still blocks for (``benchmarks/nostall.py --only blocked``). A
saver keeps one thread instead, started at its first save, and hands it each save's work through a
queue. It is a daemon thread, as the per-save threads were (a process that exits does not wait for a
save stuck in a collective), and it ends once its saver is gone.

The thread runs ``BACKGROUND_NICENESS`` below the priority it started with. Linux's scheduler favours a
thread it has just woken, so on cores the ranks keep busy the save thread, woken by ``save()``, took
the core of the training thread before ``save()`` returned: half the lazy saves of llama-tiny on 2
ranks and 2 cores blocked 2-9 ms instead of 1.2 ms. Niced, it runs when the loop waits (or on a free
core, where nothing changes); the throughput measured with and without was the same.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_STOP = None
BACKGROUND_NICENESS = 10


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
    _lower_priority()
    while (job := jobs.get()) is not _STOP:
        function, args, done = job
        try:
            function(*args)
        finally:
            done.set()
            del job, function, args  # nothing of a finished save is kept alive while the thread waits


def _lower_priority() -> None:
    """Lowers the calling thread's scheduling priority by ``BACKGROUND_NICENESS`` (Linux: a thread's own
    nice value); where that is not possible it keeps the one it has."""
    try:
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, niceness + BACKGROUND_NICENESS))
    except (AttributeError, OSError):
        pass
