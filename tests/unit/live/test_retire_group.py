"""``live/collective.retire`` on real gloo groups (two ranks as threads of this process): failed epochs
one after another, each group left with an operation pending on it (rank 0 in an all-reduce its peer never
joins: an epoch that ended mid-collective) or with nothing pending, each retired as ``LiveWorker.leave_epoch``
does. The process's native threads (``/proc/self/task``: gloo's are not Python threads) come back to what
they were once the groups' timeout has passed, however many epochs failed; kept alive instead (the code
before ``retire``), 20 epochs left about 120 threads behind (checked by hand)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.live.collective import retire

TIMEOUT = timedelta(seconds=1)  # the groups' (gloo's collective timeout)
CONNECT = timedelta(seconds=20)  # the store's: a loaded machine's connection is not what is tested
EPOCHS = 20
SETTLE_S = 30.0  # the most the test waits for the threads to end: far past the groups' 1 s timeout


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _groups(store: dist.TCPStore, epoch: int, pool: ThreadPoolExecutor) -> list[dist.ProcessGroup]:
    def build(rank: int) -> dist.ProcessGroup:
        connection = dist.TCPStore(store.host, store.port, is_master=False, timeout=CONNECT)
        return dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{epoch}", connection), rank, 2, TIMEOUT)

    return list(pool.map(build, range(2)))


def _settled(baseline: int) -> int:
    deadline = time.monotonic() + SETTLE_S
    while native_threads() > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return native_threads()


def test_failed_epochs_groups_threads_end_once_retired():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=CONNECT)
    with ThreadPoolExecutor(2) as pool:
        _groups(store, -1, pool)  # the pool's threads started, and gloo's first group's one-time threads
        baseline = native_threads()
        grew = 0
        for epoch in range(EPOCHS):
            groups = _groups(store, epoch, pool)
            if epoch % 2 == 0:  # rank 0 left in a collective its peer never joins; the work dropped, as the rank does
                groups[0].allreduce([torch.ones(4)])
            grew = max(grew, native_threads() - baseline)
            for group in groups:
                retire(group, TIMEOUT)
            del groups, group
        assert grew > 0  # each epoch's group had threads of its own
        assert _settled(baseline) <= baseline
