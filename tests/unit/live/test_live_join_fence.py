"""A rank waiting out of the quorum to join (``LiveWorker.wait_to_be_let_in``) on a real ``TCPStore``:
the lighthouse now judges such a rank's heartbeat too (a hung one is found, fenced and replaced), so a
process that was replaced while it waited (silent behind a cut link, then back) must not take the join
epoch meant for its replacement: it is fenced instead. Its replacement, which asked after the fence was
raised, is let in."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard.live.quorum import Quorum, fence_key, publish
from trainguard.live.worker import Fenced, LiveArgs, LiveWorker


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _worker(store, run_dir) -> LiveWorker:
    args = LiveArgs(store=f"127.0.0.1:{store.port}", rank=3, spare=None, world=4, group_size=2, steps=10,
                    run_dir=run_dir, micro_batches=4, micro_batch_s=0.0, checkpoint_every=0,
                    collective_timeout_s=5.0, rejoin=True, fail_after_reduce=None, doctor=False, doctor_faults=None,
                    stall_collective=None, stall_cut=False, resume=None)
    model = torch.nn.Linear(2, 1)
    return LiveWorker(store, args, 3, model, torch.optim.SGD(model.parameters(), lr=0.1), lambda *_: None, None,
                      seed=0)


def _join_epoch(store):
    publish(store, Quorum(0, [0, 1, 2, 3], 0, "start"))
    publish(store, Quorum(1, [0, 1], 5, "ranks [2] died"))
    return Quorum(2, [0, 1, 2, 3], None, "replica group 1 rejoins", joining=[2, 3], source=0)


def test_a_process_replaced_while_it_waited_to_join_is_fenced_not_let_in(store, tmp_path):
    join = _join_epoch(store)
    worker = _worker(store, tmp_path)
    asked_in, fence = 1, worker.fence()  # it asked in epoch 1, unfenced
    store.set(fence_key(3), "1")  # then found silent out of the quorum and replaced
    publish(store, join)  # the join epoch of its replacement
    with pytest.raises(Fenced):
        worker.wait_to_be_let_in(asked_in, fence)


def test_a_replacement_that_asked_after_the_fence_is_let_in(store, tmp_path):
    join = _join_epoch(store)
    store.set(fence_key(3), "1")
    worker = _worker(store, tmp_path)
    asked_in, fence = 1, worker.fence()
    publish(store, join)
    assert worker.wait_to_be_let_in(asked_in, fence) == join
