"""Both modes reach their SDC verdict through one path: the same plugin (``guards/plugins/sdc.SdcRerun``) asked
through the same ``decide_step``, fed each mode's real detector state (the closure mode's ``SdcGuard`` through
its all-reduce of slots, ``step/plugins/sdc.ClosureSdcVotes``; live mode's ``LiveSdc`` through the sum's extras,
``live/sdc.LiveSdcVotes``), on one process. Each RERUN is carried out as the mode's engine carries it out
(``ClosureStep.rerun``, ``LiveStep.rerun``): the same backward again, reduced again with the judge's flags."""

from __future__ import annotations

import logging

import pytest
import torch

from trainguard.events import EventLog
from trainguard.events.log import read_events
from trainguard.guards.plugins.sdc import SdcRerun
from trainguard.guards.sdc import SdcConfig
from trainguard.guards.step_engine import decide_step
from trainguard.guards.step_plugin import Exclusion, RerunJudge, StepCheck
from trainguard.guards.step_slots import Reduced, local_slots, reduce_step
from trainguard.guards.step_verdict import Decision, StepVerdict
from trainguard.live.group_reduce import StepSum
from trainguard.live.sdc import LiveSdc, LiveSdcVotes
from trainguard.live.step_judge import live_check
from trainguard.step.plugins.sdc import ClosureSdcVotes
from trainguard.step.sdc import SdcGuard

APPLY, SKIP, ABORT = StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.ABORT
CPU = torch.device("cpu")
LOG = logging.getLogger("test")
MICRO_BATCHES = 2  # live mode: both rank 0's (one member), the closure mode: one pass over both
STEP = 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def loss_of(net: torch.nn.Module, micro_batch: int, blown_up: bool) -> torch.Tensor:
    """A micro-batch's loss; ``blown_up``: scaled by 1e9, as a miscompute would (into the LayerNorm too)."""
    inputs = torch.arange(4.0).repeat(3, 1) * (micro_batch + 1) / 10
    loss = net(inputs).square().mean() / MICRO_BATCHES
    return loss * (1e9 if blown_up else 1.0)


def config(strikes: int) -> SdcConfig:
    sdc = SdcConfig(enabled_level=2, strikes=strikes)
    sdc.validate()
    return sdc


def closure_verdict(tmp_path, strikes: int, first: bool, again: bool) -> tuple[Decision, SdcRerun]:
    """The closure mode's step: the backward (micro-batch 0 ``first`` blown up), the all-reduce of the norm, the
    loss and the plugin's flags, the plugin asked; the rerun (``again`` blown up) reduced with its verdict slots."""
    net = model()
    events = EventLog(tmp_path / "closure.jsonl", rank=0)
    guard = SdcGuard(config(strikes), net, MICRO_BATCHES, CPU, 0, "h", LOG, events)
    plugin = SdcRerun(ClosureSdcVotes(guard, events, rank=0, world_size=1, device=CPU))

    def backward(blown_up: bool) -> torch.Tensor:
        net.zero_grad(set_to_none=True)
        guard.begin_pass()
        losses = [loss_of(net, m, blown_up and m == 0) for m in range(MICRO_BATCHES)]
        for loss in losses:
            loss.backward()
        return sum(loss.detach() for loss in losses)

    def reduce(loss: torch.Tensor, flags: dict) -> Reduced:
        grads = [p.grad for p in net.parameters()]
        return reduce_step(grads, local_slots(CPU, loss.double(), flags), 1, known=guard.take_gradient_norms())

    loss = backward(first)
    reduced = [reduce(loss, plugin.flags(STEP))]

    def rerun(judge: RerunJudge) -> StepVerdict:  # ``ClosureStep.rerun``
        reduced[0] = reduce(backward(again), judge.rerun_flags(STEP, True))
        return judge.after_rerun(STEP, reduced[0], True)

    return decide_step([plugin], lambda: StepCheck(STEP, reduced[0], None), rerun), plugin


def live_verdict(tmp_path, strikes: int, first: bool, again: bool) -> tuple[Decision, SdcRerun]:
    """Live mode's step: each micro-batch computed with its values in the sum's extras, the sum, the plugin
    asked on ``LiveSdcVotes``; the rerun (``LiveStep.rerun``) summed again with the judge's flags."""
    net = model()
    sdc = LiveSdc(config(strikes), net, MICRO_BATCHES, rank=0, run_dir=tmp_path, log=LOG,
                  events=EventLog(tmp_path / "live.jsonl", rank=0), reports=lambda: True)

    def summed(blown_up: bool, flags: list[int]) -> StepSum:
        extras, total, loss = torch.zeros(MICRO_BATCHES, sdc.width), None, 0.0
        sdc.begin_step()
        for m in range(MICRO_BATCHES):
            net.zero_grad(set_to_none=True)
            micro = loss_of(net, m, blown_up and m == 0)
            micro.backward()
            extras[m] = sdc.micro_batch_values()
            grad = torch.cat([p.grad.flatten() for p in net.parameters()])
            total, loss = (grad if total is None else total + grad), loss + float(micro.detach())
        offset = 0
        for p in net.parameters():  # the gradients set from the sum, as the worker sets them
            p.grad = total[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return StepSum(total, loss, flags, extras)

    first_sum = summed(first, [])
    plugin = SdcRerun(LiveSdcVotes(sdc, [0] * MICRO_BATCHES, first_sum))

    def rerun(judge: RerunJudge) -> StepVerdict:  # ``LiveStep.rerun``
        return judge.after_rerun(STEP, summed(again, judge.rerun_flags(STEP, True)), True)

    return decide_step([plugin], lambda: live_check(STEP, 0.0, first_sum.loss), rerun), plugin


def rerun_verdicts(path) -> list[str]:
    return [e["verdict"] for e in read_events(path) if e["kind"] == "sdc_rerun"]


@pytest.mark.parametrize("first, again, verdict, label", [
    (False, False, APPLY, None),  # nothing detected: no rerun
    (True, False, APPLY, "transient"),  # the rerun differs and is clean: its gradients are used
    (True, True, SKIP, "reproducible"),  # the rerun is the same: the step is skipped
])
def test_both_modes_reach_the_same_verdict_through_the_same_plugin(tmp_path, first, again, verdict, label):
    closure, closure_plugin = closure_verdict(tmp_path, 3, first, again)
    live, live_plugin = live_verdict(tmp_path, 3, first, again)
    assert type(closure_plugin) is type(live_plugin) is SdcRerun
    assert closure == Decision(verdict, None if verdict is APPLY else closure_plugin)
    assert live == Decision(verdict, None if verdict is APPLY else live_plugin)
    expected = [] if label is None else [label]
    assert rerun_verdicts(tmp_path / "closure.jsonl") == rerun_verdicts(tmp_path / "live.jsonl") == expected


def test_a_struck_out_device_is_the_same_abort_and_exclusion_whose_reaction_is_the_modes(tmp_path):
    """One strike is the limit: the transient fault strikes rank 0 out in both modes, ABORT with the same
    exclusion. Its ``update`` is what live mode goes on with before rank 0 leaves at the step's boundary: the
    clean rerun's (APPLY); the closure mode ends the run with the step saved unapplied (``unapplied_step``)."""
    closure, closure_plugin = closure_verdict(tmp_path, 1, True, False)
    live, live_plugin = live_verdict(tmp_path, 1, True, False)
    assert closure == Decision(ABORT, closure_plugin) and live == Decision(ABORT, live_plugin)
    assert closure_plugin.abort_cause() == Exclusion([0], "SDC strikes", unapplied_step=STEP, update=SKIP)
    assert live_plugin.abort_cause() == Exclusion([0], "SDC strikes", unapplied_step=STEP, update=APPLY)
    assert rerun_verdicts(tmp_path / "closure.jsonl") == rerun_verdicts(tmp_path / "live.jsonl") == ["faulty"]
