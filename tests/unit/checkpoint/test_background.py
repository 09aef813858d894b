"""The savers' background thread: jobs in order, each signalled when done, at a lower priority."""

from __future__ import annotations

import os
import threading

from trainguard.checkpoint.background import BACKGROUND_NICENESS, BackgroundWorker


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_jobs_run_in_order_on_one_thread_below_the_callers_priority():
    before = _niceness()
    worker = BackgroundWorker("test-saver")
    seen: list[tuple[int, int, int]] = []
    record = lambda index: seen.append((index, threading.get_ident(), _niceness()))  # noqa: E731
    done = [worker.run(record, index) for index in range(3)]
    assert all(event.wait(10) for event in done)
    assert [index for index, _, _ in seen] == [0, 1, 2]
    assert len({thread for _, thread, _ in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert {niceness for _, _, niceness in seen} == {min(19, before + BACKGROUND_NICENESS)}
    assert _niceness() == before  # the caller's own priority is untouched
