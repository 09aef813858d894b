"""The save policy of CheckpointManager.save(step, last_step=...): which tier saves which step."""

from __future__ import annotations

import pytest

from trainguard.checkpoint.save_policy import SaveDecision, decide_save


def decide(step, *, save_interval=4, local_interval=0, last_step=False, stopping=False, unhealthy=False,
           durable_saved=None, local_saved=None) -> SaveDecision:
    return decide_save(step, save_interval=save_interval, local_interval=local_interval, last_step=last_step,
                       stopping=stopping, unhealthy=unhealthy, durable_saved=durable_saved, local_saved=local_saved)


def test_durable_every_interval_only():
    assert [s for s in range(1, 13) if decide(s).durable] == [4, 8, 12]
    assert not any(decide(s, save_interval=0) for s in range(1, 13))


@pytest.mark.parametrize("save_interval, expected", [(4, True), (0, False)])
def test_last_step_saved_only_with_periodic_saves_on(save_interval, expected):
    assert decide(7, save_interval=save_interval, last_step=True).durable is expected


@pytest.mark.parametrize("save_interval", [0, 4])
def test_a_stop_is_always_saved_durably_and_never_locally(save_interval):
    decision = decide(7, save_interval=save_interval, local_interval=7, stopping=True)
    assert decision == SaveDecision(durable=True, local=False)


def test_no_tier_saves_a_step_twice():
    assert not decide(8, stopping=True, durable_saved=8).durable  # a stop right after the scheduled save
    assert not decide(8, local_interval=4, local_saved=8).local
    assert decide(8, local_interval=4, local_saved=4).local


def test_local_on_its_own_interval_and_only_healthy():
    assert [s for s in range(1, 7) if decide(s, save_interval=0, local_interval=2).local] == [2, 4, 6]
    unhealthy = decide(4, local_interval=2, unhealthy=True)
    assert unhealthy == SaveDecision(durable=True, local=False)  # the durable copy is kept, marked
    assert bool(SaveDecision(False, False)) is False and bool(unhealthy) is True


def test_memory_tier_every_step_by_the_local_tier_rules():
    def memory(step, **kw):
        return decide_save(step, save_interval=4, local_interval=0, last_step=False, durable_saved=None,
                           local_saved=None, **{"stopping": False, "unhealthy": False, **kw}).memory

    assert [s for s in range(1, 6) if memory(s, memory_interval=1)] == [1, 2, 3, 4, 5]
    assert not memory(3, memory_interval=0)
    assert not memory(3, memory_interval=1, stopping=True)  # a stop's save goes to the durable tier
    assert not memory(3, memory_interval=1, unhealthy=True)
    assert not memory(3, memory_interval=1, memory_saved=3)  # not twice (right after a resume from it)
    assert decide_save(3, save_interval=0, local_interval=0, last_step=False, stopping=False, unhealthy=False,
                       durable_saved=None, local_saved=None, memory_interval=1)  # a memory save is a save
