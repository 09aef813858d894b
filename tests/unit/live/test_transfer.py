"""``live.transfer.send_shards``: a join's state transfer on a real gloo group (the ranks as threads): 3
replica groups of 2, group 2 joining. Each joiner loads its own shard's state from that shard's lowest
live replica, and the run state and loop objects of the quorum's lowest live rank, whatever its own shard's
source holds; a survivor that sources nothing passes the transfer on and counts no bytes. The runs that
join through it end bitwise equal to their fault-free twins: tests/integration/test_live_recovery.py."""

from __future__ import annotations

import logging

import torch
from helpers.counter import Counter
from helpers.gloo_threads import run_ranks

from trainguard.events import EventLog
from trainguard.guards.skip import SkipConfig
from trainguard.guards.step_skips import StepSkips
from trainguard.live.quorum import Quorum
from trainguard.live.state import LiveState
from trainguard.live.step_judge import LiveJudge
from trainguard.live.transfer import send_shards

GROUP_SIZE = 2
JOINERS = [4, 5]
QUORUM = Quorum(epoch=3, members=[0, 1, 2, 3, 4, 5], start_step=None, reason="replica group 2 rejoins",
                joining=JOINERS, source=0)


def rank_state(rank: int) -> LiveState:
    """A survivor's state after ``rank`` + 1 updates on its own data (every rank's distinct, so a wrong
    source shows); a joiner's as a fresh process holds it."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    judge = LiveJudge(StepSkips(SkipConfig(), 0, logging.getLogger("test_transfer"), EventLog(None).emit,
                                reports=lambda: False))
    state = LiveState(model, optimizer, judge, stateful={"data": Counter()})
    if rank not in JOINERS:
        for step in range(rank + 1):
            model(torch.full((1, 3), float(step + rank))).sum().backward()
            optimizer.step()
            state.stateful["data"].seen += 10 * rank + step
    return state


def test_each_joiner_loads_its_shard_from_its_replica_and_the_run_state_from_the_lowest_live_rank():
    states = {rank: rank_state(rank) for rank in QUORUM.members}
    before = {rank: {name: value.clone() for name, value in states[rank].model.state_dict().items()}
              for rank in QUORUM.members}
    moved = run_ranks(QUORUM.members, lambda group, rank: send_shards(
        group, QUORUM, rank, GROUP_SIZE, states[rank], lambda work: work.wait()))
    for joiner, source in ((4, 0), (5, 1)):  # shard 0 from rank 0, shard 1 from rank 1
        loaded = states[joiner].model.state_dict()
        assert all(torch.equal(loaded[name], before[source][name]) for name in loaded), joiner
        assert states[joiner].optimizer.state_dict()["state"][0]["step"] == source + 1
        assert states[joiner].stateful["data"].seen == states[0].stateful["data"].seen  # the lowest live rank's
    assert states[5].stateful["data"].seen != states[1].stateful["data"].seen  # so the line above could fail
    for survivor in (0, 1, 2, 3):  # the survivors' own states are untouched
        assert all(torch.equal(value, before[survivor][name])
                   for name, value in states[survivor].model.state_dict().items())
    assert moved[0] == moved[4] > 0 and moved[1] == moved[5] > 0
    assert moved[2] == moved[3] == 0  # passed on only
