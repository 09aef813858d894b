"""Data skip on global-norm spikes: the reference's rule and words, the adaptive mode, resumable state."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.errors import EXIT_DATA_SKIP_ABORT, CheckpointError, ConfigError
from trainguard.guards import ADAPTIVE_STD_FLOOR, DataSkipAbort, DataSkipGuard, SkipConfig
from trainguard.guards.skip import MAD_TO_STD, reference_abort_message, reference_log_lines


def guard(**overrides) -> DataSkipGuard:
    return DataSkipGuard(SkipConfig(enabled=True, **overrides))


def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------------- the reference
def test_reference_log_lines_for_a_spike():
    decision = guard(threshold=3.0, count_threshold=10).decide(step=1, global_norm=44.313248, opt_global_step=0)
    assert decision.skip and not decision.abort and not decision.nan
    assert decision.consecutive == 1
    assert decision.threshold == 3.0
    assert reference_log_lines(decision) == (
        "opt_global_step: 0, skip_data_grad_norm_threshold: 3.0, is_skip: [ True]",
        "Current global norm [44.313248] of step 1 has been 1 consecutive times greater than threshold: 3.0",
    )
    assert reference_abort_message(decision) is None


def test_reference_abort_message_at_the_count():
    g = guard(threshold=3.0, count_threshold=2)
    g.decide(1, 44.313248, 0)
    decision = g.decide(2, 47.329006, 0)
    assert decision.skip and decision.abort and decision.consecutive == 2
    assert reference_log_lines(decision) == ("opt_global_step: 0, skip_data_grad_norm_threshold: 3.0, is_skip: [ True]",)
    assert reference_abort_message(decision) == (
        "Current global norm [47.329006] of step 2 has been 2 consecutive times greater than threshold 3.0, "
        "stop training..."
    )
    error = DataSkipAbort(reference_abort_message(decision))
    assert error.exit_code == EXIT_DATA_SKIP_ABORT and str(error) == reference_abort_message(decision)


def test_normal_step_logs_only_is_skip_false():
    decision = guard(threshold=3.0).decide(7, 1.25, 6)
    assert not decision.skip and not decision.abort and decision.consecutive == 0
    assert reference_log_lines(decision) == ("opt_global_step: 6, skip_data_grad_norm_threshold: 3.0, is_skip: [False]",)


def test_threshold_is_printed_as_python_float_repr():
    decision = guard(threshold=270).decide(1, 300.0, 0)
    assert "skip_data_grad_norm_threshold: 270.0," in reference_log_lines(decision)[0]
    assert reference_log_lines(decision)[1].endswith("threshold: 270.0")


def test_equal_to_threshold_is_not_a_spike():
    assert not guard(threshold=3.0).decide(1, 3.0, 0).skip


def test_normal_step_resets_the_count():
    g = guard(threshold=3.0, count_threshold=3)
    assert [g.decide(s, n, 0).consecutive for s, n in enumerate([5.0, 5.0, 1.0, 5.0, 5.0], 1)] == [1, 2, 0, 1, 2]
    assert g.skipped_total == 4 and g.consecutive == 2
    assert not g.decide(6, 1.0, 0).abort and g.consecutive == 0
    assert g.decide(7, 5.0, 0).consecutive == 1  # five spikes in all, never three in a row: no abort


def test_abort_exactly_at_count_threshold():
    g = guard(threshold=1.0, count_threshold=4)
    decisions = [g.decide(s, 2.0, 0) for s in range(1, 5)]
    assert [d.abort for d in decisions] == [False, False, False, True]
    assert all(d.skip for d in decisions)
    assert reference_abort_message(decisions[-1]).startswith("Current global norm [2.000000] of step 4 has been 4 consecutive")


def test_count_threshold_one_aborts_on_the_first_spike():
    decision = guard(count_threshold=1).decide(1, 10.0, 0)
    assert decision.abort and decision.skip


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_norm_is_a_counted_skip(bad):
    g = guard(threshold=3.0, count_threshold=10)
    decision = g.decide(5, bad, 4)
    assert decision.skip and decision.nan and decision.consecutive == 1
    assert g.nan_total == 1 and g.skipped_total == 1
    assert reference_log_lines(decision)[0].endswith("is_skip: [ True]")
    assert f"Current global norm [{bad:.6f}] of step 5" in reference_log_lines(decision)[1]
    g.decide(6, 1.0, 4)
    assert g.nan_total == 1 and g.consecutive == 0


def test_nan_counts_toward_abort_together_with_spikes():
    g = guard(threshold=3.0, count_threshold=3)
    g.decide(1, 10.0, 0)
    g.decide(2, math.nan, 0)
    assert g.decide(3, 10.0, 0).abort
    assert g.nan_total == 1 and g.skipped_total == 3


def test_disabled_guard_never_skips_and_keeps_no_state():
    g = DataSkipGuard(SkipConfig(enabled=False, threshold=1.0, count_threshold=1))
    decision = g.decide(1, 100.0, 0)
    assert not decision.skip and not decision.abort and reference_log_lines(decision) == ()
    assert g.decide(2, math.nan, 0).nan
    assert g.skipped_total == g.nan_total == g.consecutive == 0


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"threshold": 0}, "guards.skip.threshold"),
        ({"threshold": -1.0}, "guards.skip.threshold"),
        ({"threshold": math.nan}, "guards.skip.threshold"),
        ({"count_threshold": 0}, "guards.skip.count_threshold"),
        ({"count_threshold": 2.5}, "guards.skip.count_threshold"),
        ({"mode": "ema"}, "guards.skip.mode"),
        ({"window": 0}, "guards.skip.window"),
        ({"z_threshold": 0.0}, "guards.skip.z_threshold"),
        ({"warmup": -1}, "guards.skip.warmup"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        guard(**overrides)


# ------------------------------------------------------------------------------------ resume
def test_state_dict_roundtrip_mid_streak_continues_the_streak():
    g = guard(threshold=3.0, count_threshold=3)
    g.decide(1, 1.0, 0)
    g.decide(2, math.nan, 1)
    g.decide(3, 9.0, 1)
    state = roundtrip(g.state_dict())
    # the skipped 9.0 entered the window clipped to the bar (3.0); the NaN did not
    assert state == {"version": 1, "skipped_total": 2, "nan_total": 1, "consecutive": 2, "window": [1.0, 3.0],
                     "streak": [], "loss_window": [], "tokens_per_step": None}

    resumed = guard(threshold=3.0, count_threshold=3)
    resumed.load_state_dict(state)
    assert (resumed.skipped_total, resumed.nan_total, resumed.consecutive) == (2, 1, 2)
    decision = resumed.decide(4, 9.5, 1)
    assert decision.abort and decision.consecutive == 3
    assert "of step 4 has been 3 consecutive times" in reference_abort_message(decision)


def test_adaptive_window_survives_a_resume_and_gives_the_same_decisions():
    rng = np.random.default_rng(0)
    norms = list(rng.uniform(1.0, 2.0, 60)) + [50.0, 1.5, 80.0, 1.2]
    whole = guard(mode="adaptive", window=32, warmup=10)
    expected = [whole.decide(s, n, 0) for s, n in enumerate(norms, 1)]

    first = guard(mode="adaptive", window=32, warmup=10)
    got = [first.decide(s, n, 0) for s, n in enumerate(norms[:40], 1)]
    second = guard(mode="adaptive", window=32, warmup=10)
    second.load_state_dict(roundtrip(first.state_dict()))
    got += [second.decide(s, n, 0) for s, n in enumerate(norms[40:], 41)]
    assert got == expected
    assert [d.skip for d in expected[-4:]] == [True, False, True, False]


def test_loading_a_longer_window_keeps_the_newest_values():
    g = guard(mode="adaptive", window=4, warmup=2)
    g.load_state_dict({"version": 1, "skipped_total": 0, "nan_total": 0, "consecutive": 0,
                       "window": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    assert g.window == (3.0, 4.0, 5.0, 6.0)


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"version": 2, "skipped_total": 0, "nan_total": 0, "consecutive": 0, "window": []},
        {"version": 1, "skipped_total": -1, "nan_total": 0, "consecutive": 0, "window": []},
        {"version": 1, "skipped_total": 0, "nan_total": 0, "consecutive": 1.5, "window": []},
        {"version": 1, "skipped_total": 0, "nan_total": 0, "consecutive": 0, "window": [math.nan]},
        {"version": 1, "skipped_total": 0, "nan_total": 0, "consecutive": 0, "window": 3},
        {"version": 1, "skipped_total": 0, "nan_total": 0, "consecutive": 0},
    ],
)
def test_malformed_state_is_a_checkpoint_error(state):
    with pytest.raises(CheckpointError, match="data skip guard state is malformed"):
        guard().load_state_dict(state)


# ---------------------------------------------------------------------------------- adaptive
def test_adaptive_no_skip_during_warmup_except_non_finite():
    g = guard(mode="adaptive", window=16, warmup=5, threshold=0.001)  # the absolute threshold is ignored
    decisions = [g.decide(s, n, 0) for s, n in enumerate([1.0, 1e6, 2.0, 3.0], 1)]
    assert not any(d.skip for d in decisions)
    assert all(d.threshold == math.inf for d in decisions)
    assert "skip_data_grad_norm_threshold: inf," in reference_log_lines(decisions[0])[0]
    assert g.decide(5, math.nan, 0).skip and g.nan_total == 1


def test_adaptive_threshold_is_median_plus_z_mad():
    values = [1.0, 2.0, 3.0, 4.0, 50.0]  # one outlier moves neither the median nor the MAD
    g = guard(mode="adaptive", window=8, warmup=5, z_threshold=2.0)
    for s, n in enumerate(values, 1):
        g.decide(s, n, 0)
    median = 3.0
    mad = float(np.median(np.abs(np.array(values) - median)))
    bar = median + 2.0 * MAD_TO_STD * mad
    assert g.current_threshold() == pytest.approx(bar)
    assert not g.decide(6, bar - 1e-9, 0).skip
    assert g.current_threshold() > bar  # that value entered the window


def test_adaptive_flat_window_uses_the_std_floor():
    g = guard(mode="adaptive", window=10, warmup=10, z_threshold=6.0)
    for s in range(1, 11):
        g.decide(s, 2.0, 0)
    bar = 2.0 * (1 + 6.0 * ADAPTIVE_STD_FLOOR)
    assert g.current_threshold() == pytest.approx(bar)
    assert not g.decide(11, 2.0 * 1.01, 0).skip  # ordinary jitter after a flat stretch is no spike
    assert g.decide(12, bar * 1.01, 0).skip


def test_adaptive_skipped_values_enter_the_window_clipped_to_the_bar():
    g = guard(mode="adaptive", window=64, warmup=20, count_threshold=100, regime_steps=0)
    for s in range(1, 41):
        g.decide(s, 1.0 + 0.02 * (s % 5), 0)
    threshold = g.current_threshold()
    decision = g.decide(41, 1e4, 0)
    assert decision.skip and g.window[-1] == threshold  # learnt, but no higher than the bar
    for s in range(42, 51):  # a streak of huge spikes raises the bar only slowly (median/MAD)
        assert g.decide(s, 1e4, 0).skip
    assert threshold < g.current_threshold() < 1.2 * threshold and g.consecutive == 10
    before = g.window
    g.decide(51, math.nan, 0)
    assert g.window == before  # a NaN never enters
    g.decide(52, 1.05, 0)
    assert g.window[-1] == 1.05 and g.consecutive == 0


def test_a_regime_change_re_adapts_instead_of_aborting():
    """A sequence-length change (128 -> 16) makes the norm ~2.8x larger and noisier for good."""
    rng = np.random.default_rng(0)
    g = guard(mode="adaptive", count_threshold=10)
    for s in range(1, 201):
        assert not g.decide(s, float(1.0 + 0.05 * rng.standard_normal()), s).skip
    decisions = [g.decide(s, float(2.8 * (1.0 + 0.15 * rng.standard_normal())), s) for s in range(201, 501)]
    assert not any(d.abort for d in decisions)
    assert [d.skip for d in decisions[:5]] == [True] * 4 + [False] and decisions[4].regime_change
    assert "regime change" in reference_log_lines(decisions[4])[1]
    assert sum(d.skip for d in decisions) <= 5 and g.consecutive == 0


def test_a_diverging_run_is_no_regime_change_and_still_aborts():
    g = guard(mode="adaptive", count_threshold=10)
    for s in range(1, 101):
        g.decide(s, 1.0 + 0.01 * (s % 3), s)
    norm, decision = 1.0, None
    for s in range(101, 111):
        norm *= 1.6  # growing without bound: not one level
        decision = g.decide(s, norm, s)
    assert decision.abort and not decision.regime_change


def test_the_loss_spike_rule_skips_a_loss_outlier_with_a_normal_norm():
    g = guard(mode="adaptive", loss=True, warmup=10)
    for s in range(1, 41):
        assert not g.decide(s, 1.0 + 0.01 * (s % 5), s, loss=3.0 - 0.001 * s + 0.01 * (s % 4)).skip
    decision = g.decide(41, 1.02, 41, loss=6.0)
    assert decision.skip and decision.loss_spike
    assert reference_log_lines(decision)[1].startswith("Current loss [6.000000] of step 41 is greater than threshold:")
    assert not g.decide(42, 1.02, 42, loss=2.97).skip
    without = guard(mode="adaptive", warmup=10)
    for s in range(1, 41):
        without.decide(s, 1.0, s)
    assert not without.decide(41, 1.0, 41, loss=6.0).skip  # off by default


def test_the_streak_and_loss_window_survive_a_resume():
    g = guard(mode="adaptive", loss=True, warmup=4, count_threshold=10)
    for s in range(1, 11):
        g.decide(s, 1.0, s, loss=2.0)
    g.decide(11, 5.0, 11, loss=2.0)
    g.decide(12, 5.1, 12, loss=2.0)
    other = guard(mode="adaptive", loss=True, warmup=4, count_threshold=10)
    other.load_state_dict(roundtrip(g.state_dict()))
    assert other.streak == g.streak and len(other.streak) == 2
    assert [other.decide(s, 5.0, s, loss=2.0).regime_change for s in (13, 14, 15)] == [False, False, True]


def test_adaptive_window_is_bounded():
    g = guard(mode="adaptive", window=3, warmup=1)
    for s, n in enumerate([1.0, 1.0, 1.0, 1.0, 1.01], 1):
        g.decide(s, n, 0)
    assert g.window == (1.0, 1.0, 1.01)


def test_adaptive_abort_uses_the_applied_threshold():
    g = guard(mode="adaptive", window=8, warmup=4, count_threshold=2)
    for s in range(1, 5):
        g.decide(s, 1.0, 0)
    g.decide(5, 100.0, 0)
    decision = g.decide(6, 100.0, 0)
    assert decision.abort
    assert reference_abort_message(decision).endswith(f"threshold {decision.threshold!r}, stop training...")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    level=st.floats(1e-3, 1e4),
    spread=st.floats(0.0, 1.0),
    warmup=st.integers(20, 256),
    window=st.integers(20, 256),
    z=st.floats(6.0, 12.0),
)
def test_adaptive_stationary_series_is_never_skipped_and_a_huge_spike_is(seed, level, spread, warmup, window, z):
    """Norms uniform in [level, level * (1 + spread)]: a new value lies at most sqrt(3) population std
    from the mean (the largest z seen over 2000 seeds x 400 steps with a window of 20 was 4.0), so with
    the default Z = 6 or above, once at least 20 values are in the window, nothing is skipped."""
    rng = np.random.default_rng(seed)
    norms = level * (1.0 + spread * rng.uniform(0.0, 1.0, 400))
    g = guard(mode="adaptive", window=window, warmup=min(warmup, window), z_threshold=z, count_threshold=3)
    decisions = [g.decide(s, float(n), s - 1) for s, n in enumerate(norms, 1)]
    assert not any(d.skip for d in decisions)
    assert g.skipped_total == 0 and len(g.window) == min(window, 400)

    spike = g.decide(401, float(1e4 * norms.mean()), 400)
    assert spike.skip and not spike.abort and spike.consecutive == 1
    assert spike.threshold < 1e4 * norms.mean()
    assert len(g.window) == min(window, 400) and g.window[-1] == spike.threshold  # clipped to the bar


def test_a_state_saved_at_other_tokens_per_step_restarts_the_adaptive_windows():
    """Issue 39: resumed after a sequence-length switch (128 -> 16 tokens a sequence), the adaptive
    guard judged the new, larger norms against the old window and skipped 14 of the next 20 steps.
    The norms' scale follows the tokens per step, which the loop declares (``Guard(tokens_per_step=)``):
    a state saved at another count warms up again; one saved at the same count continues exactly."""
    cfg = SkipConfig(enabled=True, mode="adaptive", warmup=20, count_threshold=10)
    long_sequences = DataSkipGuard(cfg, tokens_per_step=4096)
    for step in range(1, 61):
        long_sequences.decide(step, 1.0 + 0.01 * (step % 5), opt_global_step=step - 1)
    saved = roundtrip(long_sequences.state_dict())
    short_sequences = DataSkipGuard(cfg, tokens_per_step=512)
    short_sequences.load_state_dict(saved)
    skipped = [step for step in range(61, 81)
               if short_sequences.decide(step, 3.0 + 0.05 * (step % 5), opt_global_step=step - 1).skip]
    assert skipped == [] and len(short_sequences.window) == 20
    same = DataSkipGuard(cfg, tokens_per_step=4096)
    same.load_state_dict(saved)
    assert same.window == long_sequences.window and same.decide(61, 3.0, opt_global_step=60).skip
    unknown = DataSkipGuard(cfg)  # a loop that declares nothing keeps the window
    unknown.load_state_dict(saved)
    assert unknown.window == long_sequences.window
    with pytest.raises(CheckpointError, match="tokens_per_step must be an integer"):
        DataSkipGuard(cfg, tokens_per_step=512).load_state_dict({**saved, "tokens_per_step": "4096"})
