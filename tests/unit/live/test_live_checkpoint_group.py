"""The checkpoint group of an epoch is made once every member has arrived (``collective.arrive``): a wait
on a member that never comes (stopped or dead before it arrived) ends with the epoch and leaves nothing
behind. Before, the wait ran inside gloo's rendezvous in a watched thread, which the epoch's end
abandoned; the thread lived on until gloo's timeout and, resumed after its rank had moved on, made a group
and set the rank's store connection to its own blocked one (the next epoch's save then waited 30 s on it,
every member's save of that step was lost)."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from trainguard.live.collective import EpochAborted, abort_key, arrive
from trainguard.live.quorum import Quorum


def _end_epoch_soon(store: dist.TCPStore, epoch: int) -> threading.Timer:
    timer = threading.Timer(0.3, lambda: store.set(abort_key(epoch), "1"))
    timer.start()
    return timer


def test_a_save_waiting_for_a_member_that_never_arrives_ends_with_the_epoch_and_leaves_no_thread(checkpoints, store):
    quorum = Quorum(0, [0, 1], 0, "start")  # member 1 never comes
    timer = _end_epoch_soon(store, 0)
    with pytest.raises(EpochAborted, match="epoch 0 ended while this rank made its checkpoint group to save step 5"):
        checkpoints.save(quorum, 5, last_step=False, stopping=False)
    timer.join()
    assert [thread.name for thread in threading.enumerate() if thread.name.startswith("epoch-")] == []
    assert not dist.is_initialized() and checkpoints.manager is None and checkpoints.connection is None


def test_an_epoch_ended_in_the_replicas_check_before_a_save_names_that_save(checkpoints):
    """The check's collective says only that it waited in one; the line says which save it was part of
    (seen when a rank's death is read as its teardown begins: the survivors are still in the check)."""
    def check(health):
        raise EpochAborted("epoch 0 ended while this rank waited in a collective")

    with pytest.raises(EpochAborted, match="epoch 0 ended while this rank waited in a collective: the replicas' "
                                           "check before the durable save of step 5"):
        checkpoints.save(Quorum(0, [0], 0, "start"), 5, last_step=False, stopping=False, check=check)


def test_arrive_returns_once_every_member_has_arrived_and_raises_when_the_epoch_ends(store):
    beats = []
    other = threading.Thread(target=arrive, args=(store, "ckpt/3", 1, 2, 3, lambda: None, "arrived"))
    other.start()
    arrive(store, "ckpt/3", 0, 2, 3, lambda: beats.append(1), "arrived")
    other.join()
    assert store.check(["ckpt/3/arrived/0", "ckpt/3/arrived/1"])
    timer = _end_epoch_soon(store, 4)
    with pytest.raises(EpochAborted, match="epoch 4 ended while this rank waited for its peers"):
        arrive(store, "ckpt/4", 0, 2, 4, lambda: beats.append(1), "waited for its peers")
    timer.join()
    assert beats  # the rank beat while it waited
