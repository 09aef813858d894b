"""The step's all-reduce buffer: constant size whatever the world, counts of raised indicators."""

from __future__ import annotations

import math

import torch

from trainguard.guards.step_slots import SLOTS, Slot, local_slots, reduce_step


def test_buffer_size_does_not_depend_on_the_world_or_the_flags():
    cpu = torch.device("cpu")
    plain = local_slots(cpu)
    flagged = local_slots(cpu, torch.tensor(2.5, dtype=torch.float64), {Slot.SDC_STOP: True, Slot.SDC_FAULTY: 1})
    assert plain.shape == flagged.shape == (SLOTS,) == (len(Slot),)
    assert flagged[Slot.LOSS] == 2.5 and flagged[Slot.SDC_STOP] == 1 and flagged[Slot.SDC_FAULTY] == 1
    assert flagged[Slot.SDC_TRANSIENT] == 0


def test_reduce_without_a_process_group_is_this_rank_alone():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    reduced = reduce_step(grads, local_slots(torch.device("cpu"), torch.tensor(1.25, dtype=torch.float64),
                                             {Slot.SDC_STOP: True}), ranks_per_stage=1)
    assert reduced.global_norm == 5.0 and reduced.loss == 1.25
    assert reduced.count(Slot.SDC_STOP) == 1 and reduced.count(Slot.SDC_REPRODUCIBLE) == 0
    assert Slot.LOSS not in reduced.counts


def test_a_nan_gradient_gives_a_nan_norm():
    reduced = reduce_step([torch.tensor([float("nan")])], local_slots(torch.device("cpu")), ranks_per_stage=1)
    assert math.isnan(reduced.global_norm)
