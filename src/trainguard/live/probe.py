"""Which peers a rank can reach: a side channel beside gloo, for the lighthouse's verdict on a partial cut.

When every member of an epoch is in a step's all-reduce and none leaves it (``live/stall.py``), the
store cannot say which side of a cut is at fault. So every rank listens on a small TCP socket of its
own, on the interface gloo uses (``GLOO_SOCKET_IFNAME``; its address and port in ``probe_addr/<rank>``),
and, when the lighthouse asks (``probe/<epoch>``, set before it ends the epoch), connects to each peer's
socket and reports the ones it reached (``reach/<epoch>/<rank>``, a JSON list) before its usual report.
A cut link, a downed interface or a firewall that drops the node's traffic stops the probe as it stops
gloo; a rule that blocks gloo's ports alone would not (the lighthouse then keeps rank 0's group, see
``reachable_groups``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

PROBE_TIMEOUT_S = 1.0  # a peer that has not accepted a connection in this time is unreachable
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def probe_addr_key(rank: int) -> str:
    return f"probe_addr/{rank}"


def probe_key(epoch: int) -> str:
    """Set by the lighthouse before it ends an epoch whose all-reduce stalled with everyone in it."""
    return f"probe/{epoch}"


def reach_key(epoch: int, rank: int) -> str:
    return f"reach/{epoch}/{rank}"


def interface_address(names: str) -> str:
    """The IPv4 address of the first of gloo's interfaces (``GLOO_SOCKET_IFNAME`` may list several)."""
    name = names.split(",")[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError as error:
            raise RuntimeError(f"live recovery: GLOO_SOCKET_IFNAME={names!r}: no IPv4 address on interface "
                               f"{name!r} ({error.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


class PeerProbe:
    """A rank's listening socket (accepts and closes, in a daemon thread) and its probe of the others."""

    def __init__(self, store: dist.Store, rank: int):
        self.store, self.rank = store, rank
        host = interface_address(os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        self.listener: socket.socket | None = socket.create_server((host, 0))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()
        store.set(probe_addr_key(rank), f"{host}:{self.listener.getsockname()[1]}")

    def close(self) -> None:
        """The drill's cut: peers connecting to this rank are refused from now on."""
        if self.listener is not None:
            # shutdown first: a bare close leaves the socket listening while its thread waits in accept
            self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None

    @staticmethod
    def _accept(listener: socket.socket) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            connection.close()

    def reaches(self, peer: int) -> bool:
        host, port = self.store.get(probe_addr_key(peer)).decode().rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def report_if_asked(self, epoch: int, members: list[int]) -> None:
        """Before this rank's report of ``epoch``: the peers it reaches, if the lighthouse asked."""
        if not self.store.check([probe_key(epoch)]):
            return
        peers = [m for m in members if m != self.rank]
        with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:  # one timeout at most, not one per peer
            reached = [peer for peer, ok in zip(peers, pool.map(self.reaches, peers)) if ok]
        self.store.set(reach_key(epoch, self.rank), json.dumps(reached))


def read_reach(store: dist.Store, epoch: int, members: list[int]) -> dict[int, set[int]]:
    """The reports of ``epoch``'s members that wrote one."""
    return {r: set(json.loads(store.get(reach_key(epoch, r)))) for r in members
            if store.check([reach_key(epoch, r)])}


def reachable_groups(members: list[int], reach: dict[int, set[int]], group_of: Callable[[int], int]) -> list[int]:
    """The replica groups to exclude after an all-in stall: keep the most groups whose ranks all reach
    each other both ways (greedily, from each group in order, so rank 0's group wins a tie); when that
    keeps every group (the probes saw no cut), keep the lowest group alone, as the marks' rule does;
    never exclude every group (no group whole: no verdict)."""
    groups = sorted({group_of(r) for r in members})
    ranks_of = {g: [r for r in members if group_of(r) == g] for g in groups}

    def mutual(a: int, b: int) -> bool:
        return b in reach.get(a, set()) and a in reach.get(b, set())

    def fits(kept: list[int], group: int) -> bool:
        ranks = [r for g in kept for r in ranks_of[g]]
        return all(mutual(a, b) for a in ranks_of[group] for b in ranks + ranks_of[group] if a != b)

    best: list[int] = []
    for seed in groups:
        if not fits([], seed):
            continue
        kept = [seed]
        for group in groups:
            if group not in kept and fits(kept, group):
                kept.append(group)
        if len(kept) > len(best):
            best = kept
    if not best:
        return []
    if len(best) == len(groups):
        return groups[1:]
    return [g for g in groups if g not in best]
