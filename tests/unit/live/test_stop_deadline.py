"""The launcher's bound on a stop it asked for (``live/stop_deadline.py``): overdue past the bound from the
request, never while a member is inside a durable save (the marks ``stall.saving`` reads from a real
``TCPStore``, sealed as the launcher's), the clock starting again after the save. Time is the test's own."""

from __future__ import annotations

import secrets
from datetime import timedelta

import torch.distributed as dist

from trainguard.live.quorum import Quorum
from trainguard.live.signed_store import SignedStore
from trainguard.live.stall import OUT, SAVED, SAVING, reduce_key, saving
from trainguard.live.stop_deadline import StopDeadline, stop_bound_s

QUORUM = Quorum(2, [0, 1], 6, "a collective failed")


def test_the_bound_is_the_stall_bound_the_collective_timeout_and_the_heartbeat_timeout():
    assert stop_bound_s(5.0, 30.0, 10.0) == 45.0


def test_a_stop_not_taken_within_the_bound_is_overdue():
    deadline = StopDeadline(since=100.0)
    assert not deadline.overdue(145.0, saving=False, bound_s=45.0)
    assert deadline.overdue(145.5, saving=False, bound_s=45.0)


def test_a_durable_save_in_progress_is_not_judged_and_the_clock_starts_again_after_it():
    deadline = StopDeadline(since=100.0)
    assert not deadline.overdue(400.0, saving=True, bound_s=45.0)  # a slow save, long past the bound
    assert not deadline.overdue(440.0, saving=False, bound_s=45.0)
    assert deadline.overdue(446.0, saving=False, bound_s=45.0)


def test_saving_reads_the_members_marks_of_the_current_epoch():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = SignedStore(raw, secrets.token_bytes(32))
    assert not saving(store, QUORUM)  # no marks yet
    store.set(reduce_key(0), "2 6 in")
    store.set(reduce_key(1), f"1 6 {SAVING}")  # an older epoch's save: over
    assert not saving(store, QUORUM)
    store.set(reduce_key(1), f"2 6 {SAVING}")
    assert saving(store, QUORUM)
    store.set(reduce_key(1), f"2 6 {SAVED}")
    store.set(reduce_key(0), f"2 7 {OUT}")
    assert not saving(store, QUORUM)
