"""The live store as the run's own processes see it: values sealed with the run secret, foreign ones ignored.

PyTorch's ``TCPStore`` takes reads and writes from anyone who reaches its port. So every value the
launcher, the lighthouse and the ranks write goes through :class:`SignedStore` (sealed with the run's
secret for its key, ``run_secret.seal_value``), and every value they read back is checked: a value
that is not sealed so (a foreign client's, garbage, another key's value copied over) counts as absent
and is logged once per key, in one line naming it. Counters (heartbeats, join requests) are sealed values
too, each raised by one process only (its rank), so ``add`` needs no atomic increment.

Parsing is bounded as well: ``get_int`` returns an integer within the bounds the reader gives, or None
(logged once): a sealed value out of bounds is a defect of ours, and never a crash of the lighthouse.

What stays open (docs/security.md): the store itself (anyone who reaches it can read our values, and
delete or overwrite them: a denial of service, never a forged decision), and gloo's own rendezvous keys
(``pg/<epoch>/...``, ``ckpt/<epoch>/...``), written on raw connections of the same store.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from trainguard.run_secret import open_value, seal_value

POLL_S = 0.005
log = logging.getLogger("trainguard.live.store")


def serve_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """The launcher's store, listening on ``host`` alone (loopback for a run on this machine, the head
    node's address for ranks on other nodes). ``TCPStore`` itself listens on every interface; handed a
    socket bound here (``master_listen_fd``), it listens on that one."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]  # an IPv6 address as well
    listener = socket.create_server((host, 0), family=family)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())  # the store owns the socket from here


class SignedStore:
    def __init__(self, store: dist.TCPStore, secret: bytes, timeout: timedelta | None = None):
        self.raw, self.secret = store, secret
        self.timeout_s = (timeout or store.timeout).total_seconds()
        self.counters: dict[str, int] = {}  # the counters this process raises: key -> its last value
        # the keys whose foreign value was logged: once per key, so a client writing ever new garbage under a
        # key the run polls neither floods the log nor grows this set beyond the run's own key names
        self.reported: set[str] = set()

    @property
    def host(self) -> str:
        return self.raw.host

    @property
    def port(self) -> int:
        return self.raw.port

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, seal_value(self.secret, key, value.encode() if isinstance(value, str) else value))

    def read(self, key: str) -> bytes | None:
        """The key's sealed value, or None (absent, or foreign: logged once)."""
        if not self.raw.check([key]):
            return None
        sealed = self.raw.get(key)
        value = open_value(self.secret, key, sealed)
        if value is None:
            self.foreign(key, sealed, "not sealed with the run secret")
        return value

    def foreign(self, key: str, value: bytes, why: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            log.warning("trainguard: ignored a foreign value under live store key %r (%s): %r",
                        key, why, value[:80])

    def check(self, keys: list[str]) -> bool:
        return all(self.read(key) is not None for key in keys)

    def get(self, key: str) -> bytes:
        """The key's value, waiting for a valid one up to the store's timeout (as ``TCPStore.get``)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = self.read(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"live store: no valid value under {key!r} after {self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    def get_int(self, key: str, low: int, high: int) -> int | None:
        """The key's integer value if it is one within ``[low, high]``; None when absent or not (logged once)."""
        value = self.read(key)
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or not low <= number <= high:
            self.foreign(key, value, f"not an integer in [{low}, {high}]")
            return None
        return number

    def add(self, key: str, amount: int) -> int:
        """A counter this process alone raises (``amount`` > 0), or anyone reads (``amount`` 0); absent: 0."""
        if amount == 0 and key not in self.counters:
            return self.get_int(key, 0, 2 ** 62) or 0
        if key not in self.counters:  # a replacement goes on from its predecessor's count
            self.counters[key] = self.get_int(key, 0, 2 ** 62) or 0
        self.counters[key] += amount
        if amount:
            self.set(key, str(self.counters[key]))
        return self.counters[key]
