"""``live/wait_thread.py``: one thread kept across waits for real gloo sends and receives, and a wait that a
stopped peer never completes ended by ``ended()``, the next wait served by a new thread."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers.ports import free_port
from trainguard.live.collective import EpochAborted
from trainguard.live.wait_thread import WaitThread



@pytest.fixture(scope="module")
def pair():
    """Two gloo groups of one 2-rank group, ranks 0 and 1, in this process."""
    port, timeout = free_port(), timedelta(seconds=20)
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda rank_store: dist.ProcessGroupGloo(dist.PrefixStore("w", rank_store[1]),
                                                                        rank_store[0], 2, timeout),
                               [(0, master), (1, client)]))
    yield groups


def _named_threads(name: str) -> int:
    return sum(thread.name == name and thread.is_alive() for thread in threading.enumerate())


def test_one_thread_serves_every_wait_and_the_data_arrives(pair):
    waits, first = WaitThread("test-wait-kept"), None
    for value in range(5):
        sent, received = torch.full((64,), float(value)), torch.empty(64)
        send = pair[0].send([sent], 1, 3)
        waits.wait([pair[1].recv([received], 0, 3), send], lambda: None, lambda: None)
        assert torch.equal(received, sent)
        serving = [thread for thread in threading.enumerate() if thread.name == "test-wait-kept"]
        first = first or serving
        assert serving == first and first[0].is_alive()  # kept for the next wait, not one started per wait


def test_a_wait_a_peer_never_completes_ends_by_ended_and_the_next_wait_gets_a_new_thread(pair):
    waits = WaitThread("test-wait-abandoned", poll_s=0.01)
    looks, beats = [], []

    def ended() -> str | None:
        looks.append(1)
        return "peer 1 died" if len(looks) >= 3 else None

    stuck = torch.empty(8)
    with pytest.raises(EpochAborted, match="peer 1 died"):
        waits.wait([pair[0].recv([stuck], 1, 5)], ended, lambda: beats.append(1))
    assert len(looks) == 3 and len(beats) == 3
    sent, received = torch.arange(8.0), torch.empty(8)
    send = pair[1].send([sent], 0, 6)
    waits.wait([pair[0].recv([received], 1, 6), send], lambda: None, lambda: None)
    assert torch.equal(received, sent)
    assert _named_threads("test-wait-abandoned") == 2  # the abandoned one still blocked in its receive, and the new one
    pair[1].send([torch.ones(8)], 0, 5).wait()  # the abandoned receive completes: its thread ends
    threading.Event().wait(0.5)
    assert _named_threads("test-wait-abandoned") == 1
