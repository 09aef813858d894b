"""One long-lived thread that waits for gloo's sends and receives while the caller watches for their end.

gloo's point-to-point works say they are complete only once waited for, and a wait cannot be aborted
from Python, so a rank that must stop waiting when a peer dies or stops (``layout_fsdp.FsdpLayout.wait_group``)
waits in another thread and watches from its own. A thread started per wait (``collective.watched_until``)
costs its start and a look at the store before the first poll: on FSDP2's 26 exchanges a step, measured
side by side on a loaded 2-core machine, about 1.1 ms of CPU each against 0.27 ms here, where plain gloo's
all-gather took 0.23 ms (``benchmarks/README.md``, live_steady). Here the thread stays, fed one request at a
time; the caller sleeps on the request's event and looks at ``ended()`` only when a wait lasts longer than
``poll_s``. A wait given up (``EpochAborted``) leaves its thread blocked in gloo until the work's timeout:
that thread ends then, and the next wait starts a new one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from trainguard.live.collective import POLL_S, EpochAborted


@dataclass
class _Request:
    works: list[dist.Work]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _serve(requests: queue.SimpleQueue) -> None:
    """Waits for each request's works in turn until it is handed None (its owner gave it up)."""
    while (request := requests.get()) is not None:
        try:
            for work in request.works:
                work.wait()
        except BaseException as error:  # gloo's error (a peer's socket closed): raised in the caller
            request.error = error
        request.done.set()


class WaitThread:
    """``wait(works, ended, beat)``: returns once every work is done, raises its error, or raises
    ``EpochAborted`` with ``ended()``'s line as soon as it says something (looked at every ``poll_s``
    while the wait lasts, ``beat()`` with it). One caller at a time."""

    def __init__(self, name: str, poll_s: float = POLL_S):
        self.name, self.poll_s = name, poll_s
        self.requests: queue.SimpleQueue | None = None

    def wait(self, works: list[dist.Work], ended: Callable[[], str | None], beat: Callable[[], None]) -> None:
        if self.requests is None:
            self.requests = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self.requests,), name=self.name, daemon=True).start()
        request = _Request(works)
        self.requests.put(request)
        while not request.done.wait(self.poll_s):
            beat()
            why = ended()
            if why is not None:
                self.requests.put(None)  # its thread ends once the abandoned wait does
                self.requests = None
                raise EpochAborted(why)
        if request.error is not None:
            raise request.error
