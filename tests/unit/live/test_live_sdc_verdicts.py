"""``live.sdc.LiveSdc`` on one process: a step's micro-batches computed as the live worker computes them
(each one's module-point values into its row of the extras, the gradients summed in micro-batch order),
judged by the SDC plugin both modes ask (``guards/plugins/sdc.SdcRerun`` on ``live.sdc.LiveSdcVotes``,
through ``decide_step``, as ``LiveStep.integrity`` asks it), and rerun through a stand-in for the quorum's
second sum. The multi-process run is tests/integration/test_live_sdc.py; here each verdict of the rerun
table (docs/sdc.md, "In live mode")."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from trainguard.events import EventLog
from trainguard.events.log import read_events
from trainguard.guards.plugins.sdc import SdcRerun
from trainguard.guards.sdc import FaultyDeviceError, SdcConfig, faulty_ranks_path
from trainguard.guards.step_engine import decide_step
from trainguard.guards.step_plugin import Exclusion, RerunJudge
from trainguard.guards.step_verdict import StepVerdict
from trainguard.live.group_reduce import StepSum
from trainguard.live.ordered_sum import computed_by
from trainguard.live.sdc import LiveSdc, LiveSdcVotes, clock_flags
from trainguard.live.step_judge import live_check

MICRO_BATCHES, MEMBERS = 4, [0, 1]  # member i computes micro-batches i, i + 2
COMPUTED_BY = computed_by(MICRO_BATCHES, MEMBERS)
APPLY, SKIP, ABORT = StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.ABORT


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def live_sdc(net: torch.nn.Module, tmp_path, **keys) -> LiveSdc:
    config = SdcConfig(enabled_level=2, strikes=2, **keys)
    config.validate()
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    return LiveSdc(config, net, MICRO_BATCHES, rank=0, run_dir=tmp_path, log=logging.getLogger("test"),
                   events=events, reports=lambda: True)


def compute(net: torch.nn.Module, sdc: LiveSdc, blown_up: int | None, flags: list[int] | None = None) -> StepSum:
    """One step: its sum (the summed gradient, a stand-in loss, ``flags``, the extras); micro-batch ``blown_up``'s loss scaled by 1e9 (the
    gradient into the LayerNorm with it), as a miscompute on the rank that computes it would."""
    extras = torch.zeros(MICRO_BATCHES, sdc.width)
    total = None
    sdc.begin_step()
    for micro_batch in range(MICRO_BATCHES):
        net.zero_grad(set_to_none=True)
        inputs = torch.arange(4.0).repeat(3, 1) * (micro_batch + 1) / 10
        loss = net(inputs).square().mean() / MICRO_BATCHES
        (loss * (1e9 if micro_batch == blown_up else 1.0)).backward()
        extras[micro_batch] = sdc.micro_batch_values()
        grad = torch.cat([p.grad.flatten() for p in net.parameters()])
        total = grad if total is None else total + grad
    set_grads(net, total)
    return StepSum(total, 1.0, flags or [], extras)


def set_grads(net: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in net.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@dataclass(frozen=True)
class Judged:
    verdict: StepVerdict  # the SDC plugin's
    exclusion: Exclusion | None  # ABORT's: the ranks that leave at the step's boundary, the step's update meanwhile
    rerun: StepSum | None  # the rerun's sum, when one was run


def ask(sdc: LiveSdc, step: int, computed: list[int], summed: StepSum, rerun: Callable[[list[int]], StepSum]) -> Judged:
    """Step ``step`` judged as ``LiveStep.integrity`` judges it: the SDC plugin on ``LiveSdcVotes``, asked through
    ``decide_step``, its RERUN carried out as ``LiveStep.rerun`` carries it out, ``rerun`` standing in for the
    quorum's second sum."""
    plugin = SdcRerun(LiveSdcVotes(sdc, computed, summed))
    again: list[StepSum] = []

    def carry_out(judge: RerunJudge) -> StepVerdict:
        if judge.reruns_closure:
            again.append(rerun(judge.rerun_flags(step, True)))
        return judge.after_rerun(step, again[0] if again else None, judge.reruns_closure)

    decision = decide_step([plugin], lambda: live_check(step, 0.0, summed.loss), carry_out)
    assert decision.by is (None if decision.verdict is APPLY else plugin)
    return Judged(decision.verdict, plugin.exclusion, again[0] if again else None)


def judge(net: torch.nn.Module, sdc: LiveSdc, step: int, first: int | None, again: int | None) -> Judged:
    """Step ``step`` with micro-batch ``first`` blown up, rerun with ``again`` blown up (None: clean)."""
    summed = compute(net, sdc, first)
    return ask(sdc, step, COMPUTED_BY, summed, lambda flags: compute(net, sdc, again, flags))  # the rerun


def events(tmp_path, kind: str) -> list[dict]:
    return [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == kind]


def test_a_clean_step_is_clean_and_its_values_are_every_micro_batches_maximum(tmp_path):
    net = model()
    sdc = live_sdc(net, tmp_path)
    clean = judge(net, sdc, 1, None, None)
    assert (clean.verdict, clean.rerun) == (APPLY, None) and events(tmp_path, "sdc_rerun") == []
    extras = compute(net, sdc, None).extras
    values, shares, _ = sdc.values(extras)
    assert values[0] == float(extras[:, 0].max()) and shares[0] == float(extras[:, 1].max())  # "1": the LayerNorm
    assert sdc.names[0] == "1" and len(sdc.names) == 1 + 6  # and the 6 parameter gradients


def test_a_transient_fault_strikes_the_rank_that_computed_it_and_the_clean_rerun_is_used(tmp_path):
    net = model()
    sdc = live_sdc(net, tmp_path)
    outcome = judge(net, sdc, 3, first=3, again=None)  # micro-batch 3: member 1's
    assert (outcome.verdict, outcome.exclusion) == (APPLY, None)  # applied, with the rerun's sum
    assert torch.equal(outcome.rerun.gradient, compute(net, sdc, None).gradient)
    assert sdc.strikes.count("live", "rank 1") == 1 and sdc.strikes.count("live", "rank 0") == 0
    [detected] = [e for e in events(tmp_path, "sdc_detected") if e["point"] == "1"]
    assert (detected["step"], detected["computed_by"]) == (3, [1])
    [rerun] = events(tmp_path, "sdc_rerun")
    assert (rerun["verdict"], rerun["ranks"]) == ("transient", [1])


def test_a_reproducible_value_one_rank_alone_computed_is_skipped_and_struck_until_faulty(tmp_path):
    net = model()
    sdc = live_sdc(net, tmp_path)
    first = judge(net, sdc, 2, first=2, again=2)  # micro-batch 2: member 0's, the same on the rerun
    assert (first.verdict, first.exclusion) == (SKIP, None)
    second = judge(net, sdc, 5, first=0, again=0)  # strikes: 2
    # the closure mode's verdict and exclusion; live mode goes on with the step skipped, rank 0 leaves at its boundary
    assert second.verdict is ABORT and second.exclusion == Exclusion([0], "SDC strikes", unapplied_step=5,
                                                                     update=SKIP)
    assert [e["verdict"] for e in events(tmp_path, "sdc_rerun")] == ["reproducible", "faulty"]
    with pytest.raises(FaultyDeviceError, match="rank 0 reached 2 strikes") as error:
        sdc.leave_if_struck_out(tuple(second.exclusion.ranks))
    assert error.value.exit_code == 17
    [entry] = json.loads(faulty_ranks_path(tmp_path).read_text())
    assert (entry["rank"], entry["local_device"], [s["step"] for s in entry["strikes"]]) == (0, "cpu:0", [2, 5])
    state = sdc.state()
    sdc.forget([0])  # its replacement joined: the strikes were its predecessor's
    assert sdc.strikes.count("live", "rank 0") == 0 and not sdc.strikes.is_faulty("live", "rank 0")
    sdc.load(state)  # the state as a joiner receives it, and a checkpoint holds it
    assert sdc.strikes.is_faulty("live", "rank 0")


def test_no_rerun_skips_unverified_with_no_strike(tmp_path):
    net = model()
    sdc = live_sdc(net, tmp_path, rerun=False)
    outcome = ask(sdc, 4, COMPUTED_BY, compute(net, sdc, 1), rerun=lambda flags: pytest.fail("reran"))
    assert (outcome.verdict, outcome.rerun) == (SKIP, None)
    assert [e["verdict"] for e in events(tmp_path, "sdc_rerun")] == ["unverified"]
    assert sdc.strikes.count("live", "rank 1") == 0


def test_the_strikes_time_is_the_reporters_clock_carried_in_two_exact_integers():
    hi, lo = clock_flags(reports=True)
    assert 0 <= lo < 4096 and float(torch.tensor(float(hi))) == hi  # exact in float32
    assert clock_flags(reports=False) == [0, 0]


def test_sharded_parameter_gradients_are_one_point_per_shard_from_every_shards_values(tmp_path):
    """``dp_shard`` 2: each rank holds its shard's gradient rows, and ``over_shards`` (an all-gather in
    the worker; here a stand-in whose shard 1 holds twice shard 0's values) gives every member each
    shard's values, each shard's a point of its own, in ``names`` order."""
    net = model()
    config = SdcConfig(enabled_level=2)
    config.validate()
    sdc = LiveSdc(config, net, MICRO_BATCHES, rank=0, run_dir=tmp_path, log=logging.getLogger("test"),
                  events=EventLog(tmp_path / "events.jsonl", rank=0), reports=lambda: True, shards=2,
                  over_shards=lambda mine: torch.stack([mine, mine * 2]))
    gradients = [name for name in sdc.names if name.startswith("grad:")]
    assert gradients[:2] == ["grad:0.weight (shard 0)", "grad:0.bias (shard 0)"] and len(gradients) == 2 * 6
    assert gradients[6] == "grad:0.weight (shard 1)" and len(sdc.layouts) == len(sdc.names)
    values, shares, _ = sdc.values(compute(net, sdc, None).extras)
    first = sdc.names.index("grad:0.weight (shard 0)")
    assert values[first] > 0 and values[first + 6] == 2 * values[first] and shares[first + 6] == 2 * shares[first]


def test_a_sum_that_differs_on_another_shard_alone_makes_the_rerun_transient_on_every_rank(tmp_path):
    """A sharded rank holds its shard of the sum: when the rerun's sum differs on another shard only
    (a fault outside every module point), this rank learns it through ``over_shards`` (a stand-in whose
    shard 1 always differs) and judges as that shard's rank does: transient, no rank struck, where its
    own shard alone would have said reproducible and struck rank 0."""
    net = model()
    config = SdcConfig(enabled_level=2, strikes=2)
    config.validate()
    sdc = LiveSdc(config, net, MICRO_BATCHES, rank=0, run_dir=tmp_path, log=logging.getLogger("test"),
                  events=EventLog(tmp_path / "events.jsonl", rank=0), reports=lambda: True, shards=2,
                  over_shards=lambda mine: torch.stack([mine, torch.ones_like(mine)]))
    outcome = judge(net, sdc, 2, first=2, again=2)  # micro-batch 2 (member 0's), the same on the rerun
    assert outcome.verdict is SKIP  # the rerun is abnormal too
    assert [e["attribution"] for e in events(tmp_path, "sdc_attribution")] == ["transient"]
    assert sdc.strikes.count("live", "rank 0") == 0


def test_with_tensor_parallel_each_tp_ranks_module_values_are_a_point_and_a_fault_strikes_that_tp_rank(tmp_path):
    """tp 2: a slot's two tp ranks compute the same micro-batches, each filling its own block of a micro-batch's
    extras (zeros in the other's), which the sum adds: each tp rank's value of a module point is a point of its
    own (``NAME (tp T)``). Micro-batch 2 blown up on tp rank 1 alone (here a second model stands in for it) is
    found at ``1 (tp 1)`` only, computed by the slot's first rank + 1, and that rank alone is struck."""
    nets = [model(), model()]
    config = SdcConfig(enabled_level=2, strikes=2)
    config.validate()
    sdcs = [LiveSdc(config, net, MICRO_BATCHES, rank=tp_rank, run_dir=tmp_path, log=logging.getLogger("test"),
                    events=EventLog(tmp_path / "events.jsonl", rank=tp_rank), reports=lambda: True, tp=2,
                    tp_rank=tp_rank) for tp_rank, net in enumerate(nets)]
    first_tp_rank = [0, 0, 2, 2]  # slot 0 (ranks 0, 1) computes micro-batches 0-1, slot 1 (ranks 2, 3) 2-3

    def both(blown_up: int | None, flags: list[int] | None = None) -> StepSum:
        tp0, tp1 = compute(nets[0], sdcs[0], None, flags), compute(nets[1], sdcs[1], blown_up, flags)
        return StepSum(tp0.gradient, tp0.loss, tp0.flags, tp0.extras + tp1.extras)

    sdc = sdcs[0]
    assert sdc.names[:2] == ["1 (tp 0)", "1 (tp 1)"] and len(sdc.names) == 2 + 6
    assert sdc.layouts[1].endswith("tp rank 1 of 2") and len(sdc.layouts) == len(sdc.names)
    clean = both(None).extras
    values, _, _ = sdc.values(clean)
    assert values[:2] == [float(clean[:, 0].max()), float(clean[:, 1].max())]  # [planes, tp, points] per row
    outcome = ask(sdc, 3, first_tp_rank, both(2), lambda flags: both(None, flags))
    assert (outcome.verdict, outcome.exclusion) == (APPLY, None)
    detected = {(e["point"], tuple(e["computed_by"])) for e in events(tmp_path, "sdc_detected")
                if not e["point"].startswith("grad:")}
    assert detected == {("1 (tp 1)", (3,))}
    assert sdc.strikes.count("live", "rank 3") == 1 and sdc.strikes.count("live", "rank 2") == 0


def test_a_model_with_parameter_gradient_points_alone_has_empty_extras(tmp_path):
    """No module point (no norm layer, no ``points``): each micro-batch's extras are empty, with or without tp."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 2))
    config = SdcConfig(enabled_level=2, blocks=False, lm_head=False)
    config.validate()
    for tp in (1, 2):
        sdc = LiveSdc(config, net, MICRO_BATCHES, rank=0, run_dir=tmp_path, log=logging.getLogger("test"),
                      events=EventLog(tmp_path / "events.jsonl", rank=0), reports=lambda: True, tp=tp)
        assert sdc.width == 0 and sdc.names == ["grad:0.weight", "grad:0.bias"]
        values, _, _ = sdc.values(compute(net, sdc, None).extras)
        assert len(values) == 2
