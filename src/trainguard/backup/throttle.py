"""A bandwidth cap shared by every upload thread: a token bucket that sleeps whoever gets ahead."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    """Keeps the bytes reported through ``consume`` at or below ``bytes_per_s`` on average.

    A burst of up to one second's worth passes at once; after that each caller sleeps until the
    bucket has refilled for the bytes it sent. ``bytes_per_s=None`` never sleeps.
    """

    def __init__(self, bytes_per_s: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bandwidth cap must be > 0 bytes/s, got {bytes_per_s}")
        self.rate = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(bytes_per_s or 0)
        self._stamp = clock()

    def consume(self, count: int) -> None:
        if self.rate is None or count <= 0:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate) - count
            self._stamp = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


def throttle_from_mbps(mbps: float | None) -> Throttle:
    """Megabytes (10^6 bytes) per second, as ``checkpoint.mirror.bandwidth_mbps`` and ``--bandwidth-mbps``."""
    return Throttle(mbps * 1e6 if mbps else None)
