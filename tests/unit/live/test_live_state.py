"""``live.state.LiveState``: what an undo restores (the shard and the engine's run state: guards and any
LR scheduler), what a joiner loads (the lowest live rank's run state and loop objects beside its own
shard), through ``torch.save`` bytes loaded with ``weights_only=True`` as the transfer does. The runs
that use it: tests/integration/test_live_guards.py."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from helpers.counter import Counter

from trainguard.checkpoint.staging import serialised
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.guards.skip import SkipConfig
from trainguard.guards.step_skips import StepSkips
from trainguard.live.state import GUARDS, SCHEDULER, LiveState
from trainguard.live.step_judge import LiveJudge

STEPS = 12


def one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=STEPS)


def linear_then_cosine(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, [torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, 3),
                    torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS - 3)], [3])


def rank_state(make_scheduler, scheduled: bool = True) -> LiveState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    guards = LiveJudge(StepSkips(SkipConfig(), 0, logging.getLogger("test"), EventLog(None).emit,
                                 reports=lambda: False))
    return LiveState(model, optimizer, guards, make_scheduler(optimizer) if scheduled else None,
                     {"data": Counter()})


def train(state: LiveState, steps: range, loop: bool = True) -> list[float]:
    """Updates as a live step does (the loop's counter first, unless the step is a redo that no loop code sees;
    the scheduler after the optimizer); the LRs used."""
    used = []
    for step in steps:
        state.stateful["data"].seen += loop  # the loop's, before the step
        state.model.zero_grad()
        state.model(torch.full((1, 3), float(step))).sum().backward()
        used.append(state.optimizer.param_groups[0]["lr"])
        state.optimizer.step()
        state.after_update()
    return used


def over_the_wire(state: LiveState) -> dict:
    return torch.load(io.BytesIO(serialised(state.state_dict())), weights_only=True)


def same(a: LiveState, b: LiveState) -> bool:
    one, two = a.state_dict(), b.state_dict()
    return (all(torch.equal(one["model"][k], two["model"][k]) for k in one["model"])
            and one["scheduler"] == two["scheduler"] and one["stateful"] == two["stateful"]
            and one["optimizer"]["param_groups"] == two["optimizer"]["param_groups"])


@pytest.mark.parametrize("make_scheduler", [one_cycle, linear_then_cosine])
def test_an_undone_step_redone_ends_bitwise_as_the_run_that_never_undid_it(make_scheduler):
    reference, undone = rank_state(make_scheduler), rank_state(make_scheduler)
    expected = train(reference, range(STEPS))
    train(undone, range(5))
    point = undone.undo_point()
    train(undone, range(5, 6))  # step 5 committed and returned to the loop
    undone.undo(point)  # back to before step 5's update; the loop's counter stays (its loop is past step 5)
    assert undone.stateful["data"].seen == 6 and undone.scheduler.last_epoch == 5
    redone = train(undone, range(5, 6), loop=False)  # inside the call for step 6: no loop code runs again
    assert redone == expected[5:6] and train(undone, range(6, STEPS)) == expected[6:]
    assert same(undone, reference)


@pytest.mark.parametrize("make_scheduler", [one_cycle, linear_then_cosine])
def test_a_joiner_continues_bitwise_from_the_state_it_received(make_scheduler):
    reference, joiner = rank_state(make_scheduler), rank_state(make_scheduler)
    expected = train(reference, range(STEPS))
    survivor = rank_state(make_scheduler)
    train(survivor, range(7))
    joiner.load(over_the_wire(survivor))
    assert joiner.stateful["data"].seen == 7 and joiner.scheduler.last_epoch == 7
    assert train(joiner, range(7, STEPS)) == expected[7:]
    assert same(joiner, reference)


def test_the_lowest_live_ranks_run_state_and_loop_objects_win_over_the_shard_sources():
    shard_source, lowest, joiner = rank_state(one_cycle), rank_state(one_cycle), rank_state(one_cycle)
    train(shard_source, range(4))
    train(lowest, range(4))
    lowest.stateful["data"].seen = 40
    joiner.load(over_the_wire(shard_source), run_state=over_the_wire(lowest))
    assert joiner.stateful["data"].seen == 40
    assert torch.equal(joiner.model.weight, shard_source.model.weight)


def test_the_checkpoint_holds_the_engines_objects_and_the_loops_under_the_closure_modes_names():
    state = rank_state(one_cycle)
    assert list(state.checkpointed()) == [GUARDS, SCHEDULER, "data"]
    assert list(rank_state(one_cycle, scheduled=False).checkpointed()) == [GUARDS, "data"]


def test_a_state_without_what_this_rank_has_is_one_error_naming_it():
    received = over_the_wire(rank_state(one_cycle, scheduled=False))
    with pytest.raises(ConfigError, match="^live recovery: this rank has an LR scheduler and the state it received "
                                          "has none"):
        rank_state(one_cycle).load(received)
    received = over_the_wire(rank_state(one_cycle))
    del received["stateful"]["data"]
    with pytest.raises(ConfigError, match=r"holds no stateful object named \['data'\]"):
        rank_state(one_cycle).load(received)
