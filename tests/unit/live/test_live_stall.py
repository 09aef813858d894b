"""The stall watch (``live/stall.py``) on a real ``TCPStore``: an all-reduce entered and not left for
the stall bound is found once, with the members that never entered; a step somebody left is not a
stall; the bound follows the run's median step time above its floor; a gap in the watch's own looks
judges nobody; the verdict never excludes every replica group. Time is the test's own clock: what is
asserted depends on no scheduler."""

from __future__ import annotations

import secrets
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.live.quorum import Quorum
from trainguard.live.signed_store import SignedStore
from trainguard.live.stall import IN, LOOKED_AWAY_S, OUT, SAVED, SAVING, StallWatch, excluded_groups, reduce_key

MEMBERS = [0, 1, 2, 3]
QUORUM = Quorum(0, MEMBERS, 0, "start")


def group_of(rank: int) -> int:
    return rank // 2


@pytest.fixture
def store():
    """The launcher's store as the lighthouse reads it: values sealed with the run secret."""
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return SignedStore(raw, secrets.token_bytes(32))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(store, stall_s, stall_steps):
    return StallWatch(store, stall_s=stall_s, stall_steps=stall_steps, clock=Clock())


def _mark(store, rank, step, phase, epoch=0):
    store.set(reduce_key(rank), f"{epoch} {step} {phase}")


def _started(store, watch, epoch=0):
    """The watch after it has seen the epoch's first step (9, every member out of it): it judges from 10."""
    for rank in MEMBERS:
        _mark(store, rank, 9, OUT, epoch)
    assert watch.look(Quorum(epoch, MEMBERS, 9, "start"), MEMBERS) is None
    return watch


LOOK_S = 1 / 64  # close to the launcher's 10 ms poll, and exact in binary: n looks sum to exactly n * LOOK_S


def _looks(watch, seconds, quorum=QUORUM):
    """Every stall the watch reports over ``seconds`` of looks, ``LOOK_S`` apart."""
    found = []
    for _ in range(round(seconds / LOOK_S)):
        stall = watch.look(quorum, MEMBERS)
        if stall is not None:
            found.append(stall)
        watch.clock.now += LOOK_S
    return found


def test_an_all_reduce_entered_and_not_left_is_a_stall_once_naming_the_absent(store):
    watch = _started(store, _watch(store, stall_s=0.3, stall_steps=10.0))
    for rank in (0, 1, 2):
        _mark(store, rank, 10, IN)  # rank 3 left step 9's and never entered step 10's
    (stall,) = _looks(watch, 1.0)
    assert (stall.step, stall.waiting, stall.absent) == (10, [0, 1, 2], [3])
    assert stall.bound_s == 0.3 and stall.waited_s == 20 * LOOK_S  # the first look past the bound (19 looks: 0.297)


def test_a_step_somebody_left_or_another_epochs_marks_are_no_stall(store):
    watch = _started(store, _watch(store, stall_s=0.2, stall_steps=10.0))
    _mark(store, 0, 10, OUT)  # the all-reduce completed: the others are only slow to come back
    for rank in (1, 2, 3):
        _mark(store, rank, 10, IN)
    assert _looks(watch, 0.6) == []
    # in epoch 0's all-reduce of step 10 for long, but the epoch is 1 now: nobody is in its own
    newer = Quorum(1, MEMBERS, 10, "a collective failed")
    watch = _started(store, _watch(store, stall_s=0.01, stall_steps=1.0))
    for rank in MEMBERS:
        _mark(store, rank, 10, IN)
    assert watch.look(newer, MEMBERS) is None and watch.look(QUORUM, MEMBERS) is None
    watch.clock.now += 0.05
    assert watch.look(newer, MEMBERS) is None
    assert watch.look(QUORUM, MEMBERS) is not None  # the same marks in their own epoch: a stall


def test_the_first_step_of_an_epoch_is_not_judged(store):
    """A new process's first backward and gloo's first exchanges on the epoch's group are slow, not cut."""
    _mark(store, 3, 8, OUT, epoch=0)  # a joiner, still receiving the state: its last mark is of an older epoch
    joined = Quorum(1, MEMBERS, None, "replica group 1 rejoins")
    for rank in (0, 1, 2):
        _mark(store, rank, 9, IN, epoch=1)
    watch = _watch(store, stall_s=0.1, stall_steps=0.1)
    assert _looks(watch, 0.4, joined) == []
    for rank in (0, 1, 2):  # the epoch's next step is judged
        _mark(store, rank, 10, IN, epoch=1)
    assert [stall.absent for stall in _looks(watch, 0.4, joined)] == [[3]]


def test_the_bound_is_the_floor_or_a_multiple_of_the_median_step_time(store):
    watch = _watch(store, stall_s=5.0, stall_steps=10.0)
    assert watch.bound_s() == 5.0  # no step seen yet
    watch.step_times.extend([0.1, 0.2, 3.0])  # a slow step does not move the median
    assert watch.bound_s() == 5.0
    watch.step_times.extend([0.9, 0.8, 0.7])
    assert watch.bound_s() == pytest.approx(10.0 * 0.75)


def test_the_watch_measures_step_times_from_the_marks(store):
    watch = _watch(store, stall_s=5.0, stall_steps=10.0)
    for step in range(4):
        for rank in MEMBERS:
            _mark(store, rank, step, IN)
        watch.look(QUORUM, MEMBERS)
        for rank in MEMBERS:
            _mark(store, rank, step, OUT)
        watch.clock.now += 0.02
    watch.clock.now += 0.02
    _mark(store, 0, 6, IN)  # steps 4 and 5 passed between two looks: their time is shared
    watch.look(QUORUM, MEMBERS)
    assert list(watch.step_times) == pytest.approx([0.02, 0.02, 0.02, 0.04 / 3])  # 0.04 s over steps 4-6


def test_a_gap_in_the_watchs_own_looks_judges_nobody(store):
    """The lighthouse was not scheduled for a while: the all-reduce's time restarts from its next look."""
    watch = _started(store, _watch(store, stall_s=0.3, stall_steps=10.0))
    for rank in (0, 1, 2):
        _mark(store, rank, 10, IN)
    assert watch.look(QUORUM, MEMBERS) is None
    watch.clock.now += LOOKED_AWAY_S + 0.5  # far past the bound, but unseen
    assert watch.look(QUORUM, MEMBERS) is None
    (stall,) = _looks(watch, 1.0)
    assert stall.waited_s == 20 * LOOK_S


@pytest.mark.parametrize("absent, excluded", [
    ([3], [1]),  # the group of the rank that never took part
    ([2, 3], [1]),
    ([1], [0]),  # rank 0's group too, when it is the one at fault
    ([1, 3], []),  # a rank of every group: no group is left to keep, so no verdict
])
def test_the_verdict_never_excludes_every_group(absent, excluded):
    assert excluded_groups(MEMBERS, absent, group_of) == excluded


def test_one_group_alone_is_never_excluded():
    assert excluded_groups([2, 3], [3], group_of) == []


def test_a_foreign_or_malformed_mark_is_no_mark_not_a_crash(store):
    """Issue 40: a mark the stall watch reads back is parsed with bounds: a foreign one (no seal) or a
    malformed one (``int('x')`` used to end the lighthouse) counts as no mark."""
    watch = _watch(store, 2.0, 10.0)
    store.raw.set(reduce_key(0), "pwned")
    store.set(reduce_key(1), "0 x in")
    store.set(reduce_key(2), "0 5 in extra")
    store.set(reduce_key(3), "-1 5 in")
    assert watch.look(QUORUM, MEMBERS) is None and watch.current is None


def test_a_durable_save_with_a_silent_member_is_a_stall_at_the_same_bound_everyone_beating_is_a_slow_save(store):
    """The save of step 10 comes after step 9's all-reduce: every member in it, none out. While they all beat,
    no verdict (a large model's save may take long); once rank 3's beats stop (SIGSTOP), the stall names it
    silent, measured from the save's first entry, at the all-reduce's bound."""
    silent = {rank: 0.0 for rank in MEMBERS}
    watch = StallWatch(store, stall_s=0.3, stall_steps=10.0, clock=Clock(), silent_s=lambda rank: silent[rank])
    _started(store, watch)
    for rank in MEMBERS:
        _mark(store, rank, 10, SAVING)
    assert _looks(watch, 1.0) == []  # a slow save, everyone beating
    silent[3] = 0.2  # over half the floor
    (stall,) = _looks(watch, 1.0)
    assert stall.saving and (stall.step, stall.waiting, stall.absent, stall.silent) == (10, MEMBERS, [], [3])
    assert stall.waited_s == 1.0 and stall.bound_s == 0.3


def test_a_save_is_ordered_between_two_all_reduces_and_a_member_absent_from_it_is_a_stall(store):
    # stall_steps small: the step time seen (2 s from step 9's all-reduce to step 10's) leaves the floor the bound
    watch = _started(store, _watch(store, stall_s=0.3, stall_steps=0.1))
    for rank in (0, 1, 2):
        _mark(store, rank, 10, SAVING)  # rank 3 still marked out of step 9's all-reduce
    (stall,) = _looks(watch, 1.0)
    assert stall.saving and (stall.step, stall.absent, stall.silent) == (10, [3], [])
    for rank in MEMBERS:  # the save done, the next all-reduce (index 10) is judged on its own clock
        _mark(store, rank, 10, SAVED)
    assert _looks(watch, 1.0) == []
    for rank in (0, 1, 2):
        _mark(store, rank, 10, IN)
    (stall,) = _looks(watch, 1.0)
    assert not stall.saving and (stall.step, stall.absent) == (10, [3]) and stall.waited_s == 20 * LOOK_S
