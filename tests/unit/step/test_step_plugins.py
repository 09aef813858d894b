"""The step skeleton's guard plugins: each one's verdict, as pure logic on real guards (no process group,
no checkpoint); their precedence is ``test_step_precedence.py``'s."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from trainguard.config import load_config
from trainguard.events.log import EventLog
from trainguard.guards.fingerprint import FingerprintConfig
from trainguard.guards.plugins.data_skip import DataSkip
from trainguard.guards.plugins.nonfinite import NonFiniteSkip
from trainguard.guards.plugins.sdc import STEP_AFTER_RERUN, SdcRerun
from trainguard.guards.plugins.skip_streak import SkipStreakLimit
from trainguard.guards.rollback import RollbackConfig, RollbackGuard
from trainguard.guards.sdc import SdcConfig
from trainguard.guards.skip import DataSkipAbort, SkipConfig
from trainguard.guards.state_guard import StateGuard
from trainguard.guards.step_plugin import Exclusion, StepCheck
from trainguard.guards.step_skips import StepSkips
from trainguard.guards.step_slots import Reduced, Slot
from trainguard.guards.step_verdict import StepVerdict
from trainguard.step.builder import build_guard_parts, build_step_plugins
from trainguard.step.plugins.sdc import ClosureSdcVotes
from trainguard.checkpoint.spike_rollback import SpikeRollback
from trainguard.step.plugins.state import StatePlugin, state_verdict
from trainguard.step.sdc import RerunVerdict, SdcGuard
from trainguard.trainer.data import StatefulSampler

APPLY, SKIP, RERUN, ROLLBACK, ABORT = (StepVerdict.APPLY, StepVerdict.SKIP, StepVerdict.RERUN, StepVerdict.ROLLBACK,
                                       StepVerdict.ABORT)
LOG = logging.getLogger("test")


# ---------------------------------------------------------------------------------- each plugin
def reduced(norm: float = 1.0, loss: float = 2.0, **counts: int) -> Reduced:
    return Reduced(norm, loss, {slot: counts.get(slot.name, 0) for slot in Slot if slot != Slot.LOSS})


def check(step: int, norm: float = 1.0, **counts: int) -> StepCheck:
    return StepCheck(step, reduced(norm, **counts), None)


def skips(emitted: list, limit: int = 20, **skip: object) -> StepSkips:
    config = SkipConfig(**skip)
    return StepSkips(config, limit, LOG, lambda kind, **fields: emitted.append(kind), reports=lambda: True)


def test_data_skip_skips_a_spike_and_aborts_at_the_count_threshold_with_the_reference_message():
    emitted: list[str] = []
    plugin = DataSkip(skips(emitted, enabled=True, threshold=3.0, count_threshold=2))
    assert plugin.verdict(check(1, norm=1.0), APPLY) is APPLY
    assert plugin.verdict(check(2, norm=5.0), APPLY) is SKIP and emitted == ["data_skip"]
    assert plugin.verdict(check(3, norm=6.0), APPLY) is ABORT
    cause = plugin.abort_cause()
    assert isinstance(cause, DataSkipAbort) and cause.exit_code == 3
    assert "Current global norm [6.000000] of step 3 has been 2 consecutive times greater than threshold" in str(cause)
    assert emitted == ["data_skip", "data_skip", "data_skip_abort"]


def test_a_nonfinite_norm_is_skipped_and_a_finite_one_is_not():
    emitted: list[str] = []
    plugin = NonFiniteSkip(skips(emitted))
    assert plugin.verdict(check(1, norm=1e30), APPLY) is APPLY and emitted == []
    assert plugin.verdict(check(2, norm=math.nan), APPLY) is SKIP
    assert plugin.verdict(check(3, norm=math.inf), APPLY) is SKIP and emitted == ["nonfinite_skip"] * 2


def test_the_streak_counts_skipped_steps_whatever_skipped_them_and_aborts_at_its_limit():
    emitted: list[str] = []
    plugin = SkipStreakLimit(skips(emitted, limit=2))
    assert plugin.watches_every_step
    assert [plugin.verdict(check(s), v) for s, v in ((1, SKIP), (2, APPLY), (3, SKIP))] == [APPLY] * 3
    assert plugin.verdict(check(4), SKIP) is ABORT and emitted == ["skip_streak_abort"]
    assert isinstance(plugin.abort_cause(), DataSkipAbort) and "guards.max_consecutive_skips 2" in str(
        plugin.abort_cause())


def test_rollback_mode_asks_for_a_rollback_on_a_spike_and_learns_from_normal_steps():
    guard = RollbackGuard(RollbackConfig(), SkipConfig(threshold=3.0))
    plugin = SpikeRollback(guard, data=None, checkpoints=None, events=EventLog(None), samples_of=lambda check: 1,
                           reports=lambda: True)
    assert plugin.verdict(check(1, norm=1.0), APPLY) is APPLY and plugin.spike is None
    assert plugin.verdict(check(2, norm=4.0), APPLY) is ROLLBACK
    assert (plugin.spike.step, plugin.spike.metric, plugin.spike.value) == (2, "global_norm", 4.0)
    assert plugin.verdict(check(3, norm=math.nan), APPLY) is ROLLBACK  # NaN is a spike: rolled back, not skipped


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


def sdc_plugin(enabled_level: int = 2, **config) -> SdcRerun:
    sdc = SdcConfig(enabled_level=enabled_level, blocks=False, **config)
    sdc.validate()
    guard = SdcGuard(sdc, WithNorm(), 1, torch.device("cpu"), 0, "h", LOG, EventLog(None))
    return SdcRerun(ClosureSdcVotes(guard, EventLog(None), rank=0, world_size=1, device=torch.device("cpu")))


def test_an_sdc_detection_anywhere_asks_for_a_rerun_when_recovery_is_on():
    plugin = sdc_plugin()
    assert plugin.verdict(check(1), APPLY) is APPLY
    assert plugin.verdict(check(2, SDC_STOP=2, SDC_LOCAL=1), APPLY) is RERUN and plugin.votes.alone
    assert plugin.verdict(check(3, SDC_STOP=2, SDC_LOCAL=2), APPLY) is RERUN and not plugin.votes.alone
    assert sdc_plugin(enabled_level=1).verdict(check(4, SDC_STOP=1), APPLY) is APPLY  # level 1: detect and log only
    assert plugin.reruns_closure and not sdc_plugin(rerun=False).reruns_closure


def test_after_the_rerun_the_strongest_verdict_of_any_rank_decides():
    assert STEP_AFTER_RERUN == {RerunVerdict.NONE: APPLY, RerunVerdict.TRANSIENT: APPLY,
                                RerunVerdict.REPRODUCIBLE: SKIP, RerunVerdict.FAULTY: ABORT}
    plugin = sdc_plugin()
    assert plugin.after_rerun(5, reduced(SDC_TRANSIENT=1), reran=True) is APPLY
    assert plugin.after_rerun(5, reduced(SDC_TRANSIENT=1, SDC_REPRODUCIBLE=1), reran=True) is SKIP
    plugin.votes.attributed = RerunVerdict.FAULTY  # this rank's own verdict, which the gather reports
    assert plugin.after_rerun(5, reduced(SDC_REPRODUCIBLE=1, SDC_FAULTY=1), reran=True) is ABORT
    assert plugin.abort_cause() == Exclusion([0], "SDC strikes", unapplied_step=5)


@pytest.mark.parametrize("found, struck_out, recompute, verdict", [
    (False, True, True, APPLY), (True, False, False, APPLY), (True, False, True, ROLLBACK),
    (True, True, True, ABORT), (True, True, False, ABORT)])
def test_a_state_check_that_found_something_aborts_before_it_recomputes(found, struck_out, recompute, verdict):
    assert state_verdict(found, struck_out, recompute) is verdict


def state_plugins(strike_limit_reached: bool):
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()
    state = StateGuard(FingerprintConfig(interval=50), model, optimizer, [(0,)], 0, LOG, lambda *a, **k: None,
                       strike=lambda step, evidence: strike_limit_reached)
    plugins = [StatePlugin(state, None, EventLog(None), 0, LOG, before_backward=before) for before in (True, False)]
    return model, state, plugins


def test_a_shard_changed_at_rest_with_no_replica_asks_for_a_recompute_or_aborts_a_struck_out_device():
    for limit_reached, verdict in ((False, ROLLBACK), (True, ABORT)):
        model, state, (before, after) = state_plugins(limit_reached)
        state.after_update(6)
        assert before.flags(7) == {} and before.verdict(StepCheck(7, None, None), APPLY) is APPLY  # no check due
        assert not bool(after.flags(7)[Slot.STATE_AT_REST])
        assert after.verdict(check(7), APPLY) is APPLY
        with torch.no_grad():
            model.weight.view(-1)[3] *= -1.0
        assert bool(after.flags(8)[Slot.STATE_AT_REST])
        assert after.verdict(check(8, STATE_AT_REST=1), APPLY) is verdict
        if verdict is ABORT:
            assert after.abort_cause() == Exclusion([0], "fingerprint mismatches")


@pytest.mark.parametrize("overrides, integrity, update", [
    ([], ["StatePlugin"], ["NonFiniteSkip", "SkipStreakLimit"]),
    (["guards.skip.enabled=true", "guards.sdc.enabled_level=2"], ["StatePlugin", "SdcRerun"],
     ["DataSkip", "NonFiniteSkip", "SkipStreakLimit"]),
    (["guards.check_for_global_norm=true"], ["StatePlugin"], ["SpikeRollback", "NonFiniteSkip", "SkipStreakLimit"]),
])
def test_the_builder_plugs_the_configured_guards_in_their_order_of_precedence(tmp_path, quiet, overrides, integrity,
                                                                              update):
    model = WithNorm()
    sampler = StatefulSampler(64, dp_rank=0, dp_size=1, micro_batch_size=2, seed=0)
    parts = build_guard_parts(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), None, {"data": sampler},
                              load_config(None, ["checkpoint.save_interval=0", *overrides]), mesh=None,
                              pipeline_stages=1, embedding="find", hf_config=None, tokenizer=None, tokens_per_step=None)
    plugins = build_step_plugins(parts)
    names = [[type(p).__name__ for p in phase] for phase in (plugins.before_backward, plugins.integrity, plugins.update)]
    assert names == [["StatePlugin"], integrity, update]
    assert plugins.before_backward[0].before_backward and not plugins.integrity[0].before_backward
