"""``live/fsdp_comms.GroupLink`` on a real 3-rank gloo group (three ranks as threads of this process): an
exchange is one message each way between two ranks, each rank's header (status and size) before its data,
so a rank whose share failed, which does not know the size of the exchange its peers wait in, sends its
header alone and receives theirs into a buffer of the bound. One rank failing, then two at once, leave the
others with ``PeerShareFailed`` at that exchange and nothing unmatched: the exchange after it delivers every
rank's data exactly, in one send and one receive per peer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard.live.fsdp_comms import GroupChannel, GroupLink, PeerShareFailed

SIZE = 3
LARGEST_BYTES = 4 * 1000  # the bound on one exchange's data: the largest gathered here, 1000 float32


@pytest.fixture(scope="module")
def links():
    timeout = timedelta(seconds=20)
    stores = [dist.TCPStore("127.0.0.1", 0, SIZE, True, timeout=timeout, wait_for_workers=False)]
    stores += [dist.TCPStore("127.0.0.1", stores[0].port, SIZE, False, timeout=timeout) for _ in range(SIZE - 1)]
    with ThreadPoolExecutor(SIZE) as pool:
        groups = list(pool.map(lambda rank: dist.ProcessGroupGloo(dist.PrefixStore("g", stores[rank]), rank, SIZE,
                                                                  timeout), range(SIZE)))
    waits, works_waited = [0] * SIZE, [0] * SIZE

    def channel(rank: int) -> GroupChannel:
        def wait_group(works: list[dist.Work]) -> None:
            waits[rank] += 1
            works_waited[rank] += len(works)
            for work in works:
                work.wait()
        return GroupChannel(groups[rank], list(range(SIZE)), wait_group)

    yield [GroupLink(rank, SIZE, lambda rank=rank: channel(rank), LARGEST_BYTES) for rank in range(SIZE)], waits, \
        works_waited


def _all_gather(link: GroupLink, numel: int) -> torch.Tensor:
    """Each rank's ``numel`` values (its rank plus an index), gathered in position order."""
    gathered = torch.full((SIZE, numel), -1.0)
    gathered[link.position] = torch.arange(numel) + 1000.0 * link.rank
    link.swap(lambda _position: gathered[link.position], lambda position: gathered[position])
    return gathered


def _round(links: list[GroupLink], failing: set[int], numel: int) -> list[object]:
    def one(link: GroupLink) -> object:
        if link.rank in failing:
            link.fail_share()
            return "failed"
        try:
            return _all_gather(link, numel)
        except PeerShareFailed as error:
            return error
    with ThreadPoolExecutor(SIZE) as pool:
        return list(pool.map(one, links))


def test_failed_ranks_answer_an_exchange_of_a_size_they_do_not_know(links):
    links, waits, works_waited = links
    one_failed = _round(links, {2}, 1000)
    assert one_failed[2] == "failed"
    assert all(isinstance(outcome, PeerShareFailed) and "[2]" in str(outcome) for outcome in one_failed[:2])
    two_failed = _round(links, {0, 2}, 7)
    assert two_failed[0] == two_failed[2] == "failed"
    assert isinstance(two_failed[1], PeerShareFailed) and "[0, 2]" in str(two_failed[1])
    before, works_before = list(waits), list(works_waited)
    gathered = _round(links, set(), 33)
    expected = torch.stack([torch.arange(33) + 1000.0 * rank for rank in range(SIZE)])
    assert all(torch.equal(outcome, expected) for outcome in gathered)
    assert [after - was for after, was in zip(waits, before)] == [1] * SIZE  # the statuses ride with the data
    # in the same messages: one send and one receive per peer, not a header's pair beside the data's
    assert [after - was for after, was in zip(works_waited, works_before)] == [2 * (SIZE - 1)] * SIZE


def test_an_exchange_above_the_bound_is_refused_before_it_starts(links):
    """A failed peer's answer is received into a buffer of the bound: an exchange above it would not fit
    there, so it is refused in one line before anything is posted (the group's next exchange still works)."""
    links, _waits, works_waited = links
    before = list(works_waited)
    with pytest.raises(RuntimeError, match=f"above the bound of {LARGEST_BYTES}"):
        _all_gather(links[0], LARGEST_BYTES // 4 + 1)
    assert works_waited == before
    gathered = _round(links, set(), 5)
    assert all(torch.equal(outcome, torch.stack([torch.arange(5) + 1000.0 * rank for rank in range(SIZE)]))
               for outcome in gathered)
