"""Free loopback ports for the tests' servers and process groups, from a range of the pytest-xdist
worker's own.

A port found by binding port 0 is one of the kernel's ephemeral ports (``ip_local_port_range``,
32768-60999 by default), which any process may be handed next: between the test's pick and the
rank's bind, another worker's pick or outgoing connection can take it. Here each worker picks from
its own block below that range (and below the ports trainguard's ``hosts`` and ``slurm`` launchers
count up from, 29400 and 29500), so two workers never pick the same port, and the kernel hands out
none of these to a connection. ``gw0`` (or a run without workers) has 20000-21999, ``gw1``
22000-23999, up to four workers.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

FIRST_PORT = 20000
BLOCK = 2000
MAX_WORKERS = 4


def worker_index() -> int:
    """The pytest-xdist worker's number (``gw3`` -> 3), 0 without workers."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name.removeprefix("gw"))
    if index >= MAX_WORKERS:
        raise RuntimeError(f"helpers/ports.py has port blocks for {MAX_WORKERS} pytest-xdist workers, not {name}")
    return index


# where this process's next pick starts in its block, counting up: a later pick starts past the earlier
# ones (a port just closed may still be held in TIME_WAIT); random, so a new process does not retry the last
# one's ports first
_OFFSETS = itertools.count(random.randrange(BLOCK))


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of this worker's block that nothing on loopback holds now (each is bound
    until all are found)."""
    first = FIRST_PORT + worker_index() * BLOCK
    held: list[socket.socket] = []
    try:
        for _ in range(BLOCK):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", first + next(_OFFSETS) % BLOCK))
            except OSError:
                sock.close()
                continue
            held.append(sock)
            if len(held) == count:
                return [sock.getsockname()[1] for sock in held]
        raise RuntimeError(f"no {count} free ports among the {BLOCK} of pytest-xdist worker {worker_index()}'s block")
    finally:
        for sock in held:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]
