"""The lighthouse (``live/lighthouse.py``) on a real ``TCPStore``, the ranks played by the test through
the store keys they write (heartbeats, reduce marks, reports, join requests) and the launcher's calls
(``died``, ``hung``, ``poll``). Time is the test's own clock: what is asserted depends on no scheduler.

Two defects found from outside (issue 35): a group a stall verdict excluded made the survivors wait for
its hung rank's report until the heartbeat timeout (``hang_s``) although the verdict came at the stall
bound; and a rank that died while its group was out left a stale death that aborted the group's next
rejoin (with the reason "ranks [...] died") and a stale join request that let the group in before the
replacement had asked.
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.live.collective import abort_key
from trainguard.live.lighthouse import Lighthouse
from trainguard.live.probe import probe_key
from trainguard.live.quorum import LATEST, beat_key, entered_key, latest_epoch, read_quorum, ready_key, report_key
from trainguard.live.signed_store import SignedStore
from trainguard.live.stall import OUT, IN, reduce_key

LOOK_S = 1 / 64  # close to the launcher's poll, exact in binary
HANG_S = 10.0
STALL_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store():
    """The launcher's store as the lighthouse sees it: values sealed with the run secret."""
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return SignedStore(raw, secrets.token_bytes(32))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def lighthouse(store, clock, tmp_path):
    """4 ranks in replica groups [0, 1] and [2, 3]."""
    return Lighthouse(store, 4, 2, EventLog(tmp_path / "events.jsonl", rank=-1), HANG_S, STALL_S, 10.0, clock)


def _beat(store, ranks):
    for rank in ranks:
        store.add(beat_key(rank), 1)


def _run(lighthouse, store, clock, seconds, beating):
    """``seconds`` of the launcher's loop, ``LOOK_S`` apart, the ``beating`` ranks beating; the ranks
    ``hung`` found, in order."""
    found = []
    for _ in range(round(seconds / LOOK_S)):
        clock.now += LOOK_S
        _beat(store, beating)
        found += lighthouse.hung()
        lighthouse.poll()
    return found


def _entered(store, epoch, ranks):
    for rank in ranks:
        store.set(entered_key(rank), str(epoch))


def _report(store, epoch, ranks, step):
    for rank in ranks:
        store.set(report_key(epoch, rank), str(step))


def test_a_stall_verdict_shrinks_the_quorum_without_waiting_for_the_hung_ranks_report(lighthouse, store, clock):
    for rank in range(4):
        store.set(reduce_key(rank), f"0 9 {OUT}")  # the epoch's first step, every member out of it
    _run(lighthouse, store, clock, LOOK_S, beating=range(4))  # one look: steps of LOOK_S, bound STALL_S
    for rank in (0, 1, 2):
        store.set(reduce_key(rank), f"0 10 {IN}")  # rank 3 hangs before its all-reduce of step 10
    assert _run(lighthouse, store, clock, STALL_S + 0.5, beating=(0, 1, 2)) == []
    assert store.check([abort_key(0)])  # the verdict: group 1 excluded
    _report(store, 0, (0, 1, 2), 10)  # the members in the all-reduce leave it and report; rank 3 never does
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    assert latest_epoch(store) == 1, "the survivors waited for the hung rank (hang_s) after the stall verdict"
    quorum = read_quorum(store, 1)
    assert (quorum.members, quorum.start_step) == ([0, 1], 10)
    assert "stalled" in quorum.reason

    # rank 3, out of every epoch now, is still judged: silent for hang_s, it is found (the launcher kills
    # and replaces it), and its group comes back once both of its ranks have asked
    assert _run(lighthouse, store, clock, HANG_S - STALL_S, beating=(0, 1, 2)) == [3]
    lighthouse.died(3)
    _entered(store, 1, (0, 1))
    store.add(ready_key(2), 1)
    store.add(ready_key(3), 1)  # the replacement's request
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2, 3))
    join = read_quorum(store, latest_epoch(store))
    assert (join.epoch, join.members, join.joining) == (2, [0, 1, 2, 3], [2, 3])
    assert not store.check([abort_key(2)])


def test_a_member_silent_inside_the_stalled_all_reduce_counts_as_absent(lighthouse, store, clock):
    """Rank 3 enters its all-reduce of step 10 and stops there (no beats): everyone is in, but its silence
    tells the side without the probes, whose verdict would wait for the report it never sends."""
    for rank in range(4):
        store.set(reduce_key(rank), f"0 9 {OUT}")
    _run(lighthouse, store, clock, LOOK_S, beating=range(4))
    for rank in range(4):
        store.set(reduce_key(rank), f"0 10 {IN}")
    _run(lighthouse, store, clock, STALL_S + 0.5, beating=(0, 1, 2))
    assert store.check([abort_key(0)]) and not store.check([probe_key(0)])
    _report(store, 0, (0, 1, 2), 10)
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    assert latest_epoch(store) == 1, "the survivors waited for the silent rank's report"
    assert read_quorum(store, 1).members == [0, 1]


def test_a_rank_that_dies_while_its_group_is_out_leaves_no_stale_death_or_request(lighthouse, store, clock):
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    lighthouse.died(3)
    _report(store, 0, (0, 1, 2), 5)
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    assert read_quorum(store, 1).members == [0, 1]
    _entered(store, 1, (0, 1))

    store.add(ready_key(2), 1)  # rank 2 asks to join, then dies while its group is out
    lighthouse.died(2)
    store.add(ready_key(3), 1)  # rank 3's replacement asks
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 3))
    assert latest_epoch(store) == 1, "the dead rank 2's request let its group in before its replacement asked"

    store.add(ready_key(2), 1)  # rank 2's replacement asks
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=range(4))
    join = read_quorum(store, 2)
    assert (join.members, join.joining, join.reason) == ([0, 1, 2, 3], [2, 3], "replica group 1 rejoins")
    assert not store.check([abort_key(2)]), "the rejoin was aborted by rank 2's death while its group was out"
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    assert latest_epoch(store) == 2


def test_a_group_rejoins_only_once_every_member_has_entered_the_current_epoch(lighthouse, store, clock):
    """Rank 2's replacement asks at once (a forked start), while rank 1 is still building the survivors'
    epoch's group: a join published then would leave rank 1 building an epoch nobody ends if rank 0
    died meanwhile (seen: 30 s of gloo's timeout, then the run lost)."""
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    lighthouse.died(3)
    _report(store, 0, (0, 1, 2), 5)
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    store.add(ready_key(2), 1)
    store.add(ready_key(3), 1)
    _entered(store, 1, (0,))  # rank 1 has not built epoch 1's group yet
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=range(4))
    assert latest_epoch(store) == 1
    _entered(store, 1, (1,))
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=range(4))
    assert read_quorum(store, 2).joining == [2, 3]


def test_a_foreign_report_is_ignored_and_logged_once_not_a_crash(lighthouse, store, clock, caplog):
    """Issue 40: a client without the run secret wrote ``pwned`` under a report key and the lighthouse
    died of ``int(b'pwned')``. Now the value is foreign (not sealed with the secret): ignored, one log
    line however often it is read, and the real reports still end the epoch."""
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    lighthouse.died(3)
    for rank in (0, 1, 2):
        store.raw.set(report_key(0, rank), "pwned")  # a client with the address, not the secret
    with caplog.at_level(logging.WARNING, logger="trainguard.live.store"):
        _run(lighthouse, store, clock, 8 * LOOK_S, beating=(0, 1, 2))
    assert latest_epoch(store) == 0, "a foreign report ended the epoch"
    foreign = [r.getMessage() for r in caplog.records if "foreign value" in r.getMessage()]
    assert sorted(foreign) == sorted(f"trainguard: ignored a foreign value under live store key "
                                     f"'report/0/{rank}' (not sealed with the run secret): b'pwned'"
                                     for rank in (0, 1, 2))
    _report(store, 0, (0, 1, 2), 5)  # the ranks' own reports, sealed
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    assert (read_quorum(store, 1).members, read_quorum(store, 1).start_step) == ([0, 1], 5)


def test_a_sealed_report_out_of_bounds_is_ignored_not_a_crash(lighthouse, store, clock, caplog):
    """Parsing is bounded too: a sealed value that is not a step (a defect of ours) is logged and ignored."""
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    lighthouse.died(3)
    store.set(report_key(0, 0), "-7")
    store.set(report_key(0, 1), "12abc")
    with caplog.at_level(logging.WARNING, logger="trainguard.live.store"):
        _run(lighthouse, store, clock, 8 * LOOK_S, beating=(0, 1, 2))
    assert latest_epoch(store) == 0
    assert sum("not an integer in" in r.getMessage() for r in caplog.records) == 2


def test_the_newest_epoch_overwritten_from_outside_is_restored_at_the_next_look(lighthouse, store, clock):
    """Every rank reads ``latest`` at every step and waits while it holds a foreign value: the lighthouse
    puts its own back, whether garbage or an older sealed value written again (a replay)."""
    old_latest = store.raw.get(LATEST)  # epoch 0's, sealed
    _run(lighthouse, store, clock, 0.5, beating=range(4))
    lighthouse.died(3)
    _report(store, 0, (0, 1, 2), 5)
    _run(lighthouse, store, clock, 4 * LOOK_S, beating=(0, 1, 2))
    assert latest_epoch(store) == 1
    for forged in (b"pwned", old_latest):
        store.raw.set(LATEST, forged)
        _run(lighthouse, store, clock, LOOK_S, beating=(0, 1))
        assert store.raw.get(LATEST) != forged and latest_epoch(store) == 1


def test_a_member_that_never_beats_is_hung_after_the_startup_bound_not_the_heartbeat_timeout(store, clock, tmp_path):
    """Rank 3 never reaches the store (stuck in its imports, stopped at its start): its peers wait in epoch 0's
    group for it. It was never judged (only a rank that had beaten was), so they waited for its report for ever;
    now it is hung once ``startup_s`` has passed since the lighthouse first looked, not at ``hang_s``."""
    lighthouse = Lighthouse(store, 4, 2, EventLog(tmp_path / "events.jsonl", rank=-1), HANG_S, STALL_S, 10.0, clock,
                            startup_s=60.0)
    assert _run(lighthouse, store, clock, 59.0, beating=[0, 1, 2]) == []
    assert _run(lighthouse, store, clock, 2.0, beating=[0, 1, 2]) == [3]
    assert lighthouse.fenced == {3}
