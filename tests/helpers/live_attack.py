"""A client that reaches a live run's listeners and does not hold its secret (issue 40).

It learns the store's address from the launcher's ``live_store`` event (an attacker would scan for the
port), then, until stopped: writes forged control values under the run's own key names (stop, abort,
fence, reports, quorums, a spare's rank, join requests...) and random keys with random bytes, each
only where no value is yet (overwriting one of the run's values is a denial of service the secret
cannot prevent: docs/security.md), but for ``latest``, which every rank reads at every step
(the lighthouse restores it), and connects to every rank's probe socket and sends it garbage.
gloo's own keys (``pg/``, ``ckpt/``) are left alone: they stay open (docs/security.md).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainguard.events.log import read_events
from trainguard.live.files import events_path

FORGED = [  # (key pattern, value): what a client would write to stop, abort, fence or steer the run
    ("stop", "1"), ("abort/{e}", "1"), ("report/{e}/{r}", "pwned"), ("report/{e}/{r}", "3"), ("fence/{r}", "99"),
    ("epoch/{e}", json.dumps({"epoch": 9, "members": [0], "start_step": 0, "reason": "forged"})),
    ("spare/{e}", "3"), ("spare_failed/{e}", "forged"), ("spare_ready/{e}", "1"), ("start/{e}", "0"),
    ("ready/{r}", "pwned"), ("entered/{r}", "-5"), ("done/{r}", "1"), ("progress/{r}", "1e9"),
    ("reduce/{r}", "0 x in"), ("probe/{e}", "1"), ("reach/{e}/{r}", "[0, 1"), ("beat/{r}", "pwned"),
    ("probe_addr/{r}", "127.0.0.1:1"),
]


class LiveAttack:
    def __init__(self, run_dir: Path, ranks: int, seed: int = 40):
        self.run_dir, self.ranks, self.random = Path(run_dir), ranks, random.Random(seed)
        self.stopped = threading.Event()
        self.written: set[str] = set()  # the keys it wrote
        self.probed: set[int] = set()  # the ranks whose probe socket took its garbage
        self.overwrote_latest = 0  # times it wrote garbage over the newest epoch's number
        self.thread = threading.Thread(target=self.run, name="live-attack", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> LiveAttack:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)

    def store_address(self) -> tuple[str, int]:
        """The store's address, once the lighthouse has published the first epoch (a value written where
        none is yet must never land on a key the run is about to write first: that is an overwrite)."""
        while not self.stopped.is_set():
            events = list(read_events(events_path(self.run_dir))) if events_path(self.run_dir).exists() else []
            stores = [e for e in events if e["kind"] == "live_store"]
            if stores and any(e["kind"] == "live_quorum" for e in events):
                return stores[0]["host"], stores[0]["port"]
            time.sleep(0.01)
        raise RuntimeError("the run ended before its store was seen")

    def run(self) -> None:
        try:
            host, port = self.store_address()
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
            for pattern, value in FORGED:  # first every forged value for the first epochs, then at random
                for key in {pattern.format(e=e, r=r) for e in (0, 1) for r in range(self.ranks)}:
                    self.set_where_empty(store, key, value)
            while not self.stopped.is_set():
                self.write_where_empty(store)
                self.probe(store)
                if self.random.random() < 0.05:  # the one value it overwrites: the lighthouse restores it
                    store.set("latest", self.random.randbytes(8))
                    self.overwrote_latest += 1
                time.sleep(0.005)
        except BaseException as error:  # reported by the test; a failed store call while the run ends is not
            if not self.stopped.is_set():
                self.error = error

    def write_where_empty(self, store: dist.TCPStore) -> None:
        pattern, value = self.random.choice(FORGED)
        key = pattern.format(e=self.random.randrange(4), r=self.random.randrange(self.ranks))
        if self.random.random() < 0.3:  # random bytes under one of the run's key names, or a random key
            value = self.random.randbytes(self.random.randrange(1, 64))
            key = key if self.random.random() < 0.5 else f"junk/{self.random.randbytes(4).hex()}"
        self.set_where_empty(store, key, value)

    def set_where_empty(self, store: dist.TCPStore, key: str, value: str | bytes) -> None:
        if not store.check([key]):
            store.set(key, value)
            self.written.add(key)

    def probe(self, store: dist.TCPStore) -> None:
        for rank in range(self.ranks):
            key = f"probe_addr/{rank}"
            if rank in self.probed or not store.check([key]):
                continue
            # the rank's sealed value still shows its address: tg1:<mac>:<host>:<port>
            host, _, port = store.get(key).decode(errors="replace").rpartition(":")
            host = host.rpartition(":")[2]
            try:
                with socket.create_connection((host, int(port)), timeout=1) as connection:
                    connection.sendall(b"stop\n" + self.random.randbytes(64))
                self.probed.add(rank)
            except (OSError, ValueError):
                continue
