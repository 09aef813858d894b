"""Rollback mode's pure parts: the spike verdict (data skip's rule), windows, widening, the stop, skipped samples."""

from __future__ import annotations

import io
import math

import pytest
import torch

from trainguard.config import load_config
from trainguard.errors import CheckpointError, ConfigError
from trainguard.guards.rollback import RollbackAbort, RollbackConfig, RollbackGuard, Spike
from trainguard.guards.skip import DataSkipGuard, SkipConfig
from trainguard.trainer.data import StatefulSampler


def guard(**rollback) -> RollbackGuard:
    return RollbackGuard(RollbackConfig(**{"window_before": 2, "window_after": 3, **rollback}),
                         SkipConfig(threshold=10.0))


def spike(step: int) -> Spike:
    return Spike(step, "global_norm", 1e4, 10.0)


def test_the_verdict_is_data_skips_rule_in_both_modes():
    for cfg in (SkipConfig(threshold=5.0), SkipConfig(mode="adaptive", warmup=3, window=8)):
        rollback, skip = RollbackGuard(RollbackConfig(), cfg), DataSkipGuard(SkipConfig(**{**cfg.__dict__, "enabled": True}))
        clipped = []
        for step, norm in enumerate([1.0, 1.1, 0.9, 1.05, 4.0, 6.0, math.nan, 1.0, 30.0], start=1):
            verdict = rollback.check(step, norm, loss=2.0)
            decision = skip.decide(step, norm, 0)
            assert (verdict is not None) == decision.skip, (cfg.mode, step, norm)
            if verdict is not None and not clipped:  # later bars differ: data skip learns from what it skipped
                assert verdict.threshold == decision.threshold and verdict.metric == "global_norm"
            clipped += [decision.threshold] if decision.skip and math.isfinite(norm) else []
        # data skip also learns from its skipped norms (clipped to the bar); rollback restores its window
        assert rollback.norm_rule.window == tuple(n for n in skip.window if n not in clipped)


def test_loss_spikes_use_the_adaptive_rule_when_asked():
    g = RollbackGuard(RollbackConfig(loss=True), SkipConfig(threshold=1e9, warmup=4))
    for step, loss in enumerate([3.0, 2.9, 3.1, 3.0], start=1):
        assert g.check(step, 1.0, loss) is None
    verdict = g.check(5, 1.0, 9.0)
    assert verdict is not None and verdict.metric == "loss" and verdict.value == 9.0
    assert verdict.threshold == pytest.approx(3.0 + 6 * 0.05 * 3.0)  # the std floor: 5% of the mean
    assert RollbackGuard(RollbackConfig(), SkipConfig(threshold=1e9, warmup=4)).check(5, 1.0, math.nan) is None


def test_window_around_the_spike_and_a_new_spike_starts_over():
    g = guard()
    first = g.plan(spike(20))
    assert (first.first_step, first.last_step, first.attempt) == (18, 23, 1)
    later = g.plan(spike(24))  # past 20 + 3: progress was made, a new spike
    assert (later.first_step, later.last_step, later.attempt) == (22, 27, 1)


def test_a_recurring_spike_widens_the_window_then_stops_the_run():
    g = guard(widen_factor=2.0, max_rollbacks=3)
    plans = [g.plan(spike(20)), g.plan(spike(21)), g.plan(spike(20))]
    assert [(p.first_step, p.last_step, p.attempt) for p in plans] == [(18, 23, 1), (17, 27, 2), (12, 32, 3)]
    with pytest.raises(RollbackAbort) as info:
        g.plan(spike(25))
    assert info.value.exit_code == 3
    message = str(info.value)
    assert "of step 25" in message and "recurred after 3 rollbacks without progress" in message
    assert "steps 18-23, steps 17-27, steps 12-32" in message and message.endswith("stop training...")


def test_the_window_never_reaches_into_the_restored_checkpoint():
    g = guard(window_before=10)
    assert g.plan(spike(6)).first_step == 1
    assert g.starts_after(4) == 5 and g.history.windows[-1] == [5, 9]


def test_state_round_trips_through_weights_only_load():
    g = guard(loss=True)
    for step in range(1, 6):
        g.check(step, 1.0 + step / 10, 3.0)
    g.plan(spike(7))
    buffer = io.BytesIO()
    torch.save(g.state_dict(), buffer)
    buffer.seek(0)
    other = guard(loss=True)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert other.state_dict() == g.state_dict()
    assert other.plan(spike(8)).attempt == 2  # the recurrence is remembered across a restart
    with pytest.raises(CheckpointError, match="rollback guard state is malformed: missing key 'windows'"):
        other.load_state_dict({k: v for k, v in g.state_dict().items() if k != "windows"})


@pytest.mark.parametrize("key,value", [("window_before", -1), ("window_after", 1.5), ("max_rollbacks", 0),
                                       ("widen_factor", 0.5)])
def test_bad_rollback_keys_are_named(key, value):
    with pytest.raises(ConfigError, match=f"guards.rollback.{key}"):
        load_config(None, ["guards.check_for_global_norm=true", f"guards.rollback.{key}={value}"])


def test_rollback_and_data_skip_are_mutually_exclusive_naming_both_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("use_skip_data_by_global_norm: True\nmonitor_config: {check_for_global_norm: True}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "guards.check_for_global_norm" in str(info.value) and "guards.skip.enabled" in str(info.value)
    assert str(path) in str(info.value)
    cfg = load_config(None, ["guards.check_for_global_norm=true", "guards.rollback.window_after=7"])
    assert cfg.guards.check_for_global_norm and cfg.guards.rollback.window_after == 7


# ----------------------------------------------------------------------------------------- sampler
def global_stream(dp_size: int, mbs: int, batches: int, skipped=()) -> list[int]:
    samplers = [StatefulSampler(50, r, dp_size, mbs, seed=3) for r in range(dp_size)]
    for s in samplers:
        for start, end in skipped:
            s.skip(start, end)
    out = []
    for _ in range(batches):
        for s in samplers:
            out.extend(s.next_batch_indices())
    return out


def test_skipped_positions_are_never_yielded_and_every_layout_sees_the_same_stream():
    skipped = [(6, 18), (40, 41), (41, 44), (70, 75)]
    reference = StatefulSampler(50, 0, 1, 1, seed=3)
    excluded = [p for a, b in skipped for p in range(a, b)]
    expected = [reference.peek_global_indices(p, 1)[0] for p in range(0, 120) if p not in excluded][:96]
    for dp_size, mbs in ((1, 8), (2, 4), (4, 2), (8, 1), (3, 4)):
        batches = 96 // (dp_size * mbs)
        assert global_stream(dp_size, mbs, batches, skipped) == expected, (dp_size, mbs)


def test_skipped_ranges_survive_a_state_round_trip_and_a_layout_change():
    a = StatefulSampler(50, 0, 2, 2, seed=3)
    for _ in range(3):
        a.next_batch_indices()
    start, end = a.span_ahead(4, 8)
    assert (start, end) == (16, 24)
    a.skip(start, end)
    assert a.span_ahead(0, 8) == (12, 28)  # the span steps over the range already skipped
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["skipped"] == [[16, 24]]
    b = StatefulSampler(50, 0, 1, 4, seed=3)
    b.load_state_dict(state)
    before = b.consumed_samples
    first, second = b.next_batch_indices(), b.next_batch_indices()
    assert b.ranges_between(before, b.consumed_samples) == [(12, 16), (24, 28)]
    assert first + second == b.peek_global_indices(12, 4) + b.peek_global_indices(24, 4)


def test_a_malformed_skipped_list_is_refused():
    s = StatefulSampler(50, 0, 1, 1, seed=3)
    with pytest.raises(ValueError, match="skipped"):
        s.load_state_dict({"consumed_samples": 0, "seed": 3, "skipped": [[5, 2]]})
    s.load_state_dict({"consumed_samples": 4, "seed": 3})  # saved before rollback mode existed
    assert s.skipped == []
