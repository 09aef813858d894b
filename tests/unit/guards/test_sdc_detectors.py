"""SDC detection rules (v1, v3), switches and environment aliases, log lines, rerun attribution, strikes."""

from __future__ import annotations

import io
import json
import logging
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import EXIT_FAULTY_HARDWARE, CheckpointError, ConfigError
from trainguard.guards.sdc import (
    ABNORMAL,
    NOT_CHECKED,
    Attribution,
    Detection,
    FaultyDeviceError,
    RerunAttribution,
    SdcConfig,
    SdcDetector,
    StrikeBook,
    V1Detector,
    V3Detector,
    faulty_ranks_path,
    format_detection,
    format_values,
    parse_pair,
    read_faulty_ranks,
    sdc_config_from_env,
    severity,
    write_faulty_ranks,
)

INF, NAN = float("inf"), float("nan")
HOUR = 3600.0


def roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint would carry it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def levels(detector, values):
    return [detector.check(v).level for v in values]


# ------------------------------------------------------------------------------------------- v1
def warmed_v1(**kwargs) -> V1Detector:
    """count 7, pre_val 1, min 1, max 2: spread 1, so jump = val - 1."""
    detector = V1Detector(**kwargs)
    assert levels(detector, [1, 2, 1, 2, 1, 2, 1]) == [0] * 7
    assert (detector.count, detector.pre_val, detector.min_val, detector.max_val) == (7, 1, 1, 2)
    return detector


def test_v1_no_jump_test_during_the_warm_up_of_7_checks():
    detector = V1Detector()
    # huge relative jumps, all below upper[1]: nothing during the first 7 checks
    assert levels(detector, [1e-3, 9000, 1e-3, 9000, 1e-3, 9000, 1e-3]) == [0] * 7
    assert detector.jump(5.0) is not None  # the 8th check has a jump test
    fresh = V1Detector()
    assert levels(fresh, [1, 1, 1, 1, 1, 1]) == [0] * 6
    assert fresh.jump(9000.0) is None


def test_v1_jump_boundaries_level_2_then_level_1():
    detector = warmed_v1()
    assert detector.check(1 + 5000).level == 0  # jump exactly sigma[1]: not greater
    detector = warmed_v1()
    verdict = detector.check(1 + 5000.5)
    assert (verdict.level, verdict.reason) == (2, "jump")
    assert verdict.thresholds == {"upper": 10000.0, "sigma": 5000.0}
    assert verdict.state["jump"] == pytest.approx(5000.5)
    # level 1 by the jump alone: raise upper so the absolute test stays quiet
    detector = warmed_v1(upper=(1e9, 1e8))
    assert detector.check(1 + 100000).level == 2  # jump == sigma[0] is level 2 (> sigma[1])
    detector = warmed_v1(upper=(1e9, 1e8))
    verdict = detector.check(1 + 100000.5)
    assert (verdict.level, verdict.reason) == (1, "jump")
    assert verdict.thresholds == {"upper": 1e9, "sigma": 100000.0}


def test_v1_upper_boundaries():
    detector = V1Detector()
    assert detector.check(10000).level == 0  # equal: not greater
    assert (detector.check(10000.5).level, V1Detector().check(10001).reason) == (2, "upper")
    assert V1Detector().check(1e6).level == 2
    verdict = V1Detector().check(1e6 + 1)
    assert (verdict.level, verdict.reason, verdict.thresholds["upper"]) == (1, "upper", 1e6)


def test_v1_nan_and_inf_are_level_1_always_and_never_absorbed():
    for bad in (NAN, INF, -INF):
        assert V1Detector().check(bad).level == 1  # even as the very first check
        detector = warmed_v1()
        before = detector.state_dict()
        verdict = detector.check(bad)
        assert (verdict.level, verdict.reason) == (1, "non-finite")
        assert detector.state_dict() == before


def test_v1_state_update_level_0_and_2_absorbed_level_1_not():
    detector = warmed_v1()
    detector.check(1.5)
    assert (detector.count, detector.pre_val, detector.min_val, detector.max_val) == (8, 1.5, 1, 2)
    assert detector.check(20000).level == 2  # absorbed: a warning accepts the value
    assert (detector.count, detector.pre_val, detector.max_val) == (9, 20000, 20000)
    assert detector.check(2e6).level == 1
    assert (detector.count, detector.pre_val, detector.max_val) == (9, 20000, 20000)


def test_v1_jump_is_signed_a_drop_never_alarms():
    detector = V1Detector(sigma=(10, 4))
    levels(detector, [100, 101, 100, 101, 100, 101, 100])
    assert detector.check(0.0).level == 0  # jump -100
    assert detector.check(0.0 + 101 * 4.5).level == 2  # back up: jump 4.5 over the widened spread of 101


def test_v1_spread_floor_and_all_zero_history():
    constant = V1Detector()
    levels(constant, [10.0] * 7)
    assert constant.spread() == pytest.approx(0.01)  # 1e-3 of the magnitude, not 0
    assert constant.check(10.0 + 0.01 * 4999).level == 0
    constant = V1Detector()
    levels(constant, [10.0] * 7)
    assert constant.check(10.0 + 0.01 * 5001).level == 2
    zeros = V1Detector()
    levels(zeros, [0.0] * 7)
    assert zeros.jump(5.0) is None  # no spread at all: no jump test
    assert zeros.check(5.0).level == 0
    assert zeros.check(20000.0).level == 2  # the absolute thresholds still apply


# ------------------------------------------------------------------------------------------- v3
def warmed_v3(value: float = 1.0, n: int = 10, **kwargs) -> V3Detector:
    detector = V3Detector(**kwargs)
    assert levels(detector, [value] * n) == [0] * n
    return detector


def test_v3_warm_up_only_nan_alarms_and_values_feed_the_ema():
    detector = V3Detector()
    assert detector.check(1e30).level == 0  # before n >= 10: no bound
    assert detector.check(NAN).level == 1
    assert detector.n == 1 and detector.avg == pytest.approx(0.01 * 1e30)
    for _ in range(8):
        detector.check(1.0)
    assert detector.n == 9 and detector.thresholds() is None
    detector.check(1.0)
    assert detector.n == 10 and detector.thresholds() is not None


def test_v3_ema_and_bias_correction():
    values = [1.0, 2.0, 4.0, 3.0, 0.5, 1.5, 2.5, 3.5, 1.0, 2.0, 3.0]
    detector = V3Detector()
    avg = 0.0
    for v in values:
        detector.check(v)
        avg = 0.99 * avg + 0.01 * v
    assert detector.avg == pytest.approx(avg, rel=1e-15) and detector.n == len(values)
    corrected = avg / (1 - 0.99 ** len(values))
    thr1, thr2 = detector.thresholds()
    assert thr1 == pytest.approx(corrected * 1e6, rel=1e-12)
    assert thr2 == pytest.approx(corrected * 100, rel=1e-12)
    # a constant sequence: the bias-corrected mean is the constant itself
    constant = warmed_v3(7.0, n=37)
    assert constant.thresholds()[0] == pytest.approx(7e6, rel=1e-12)


def test_v3_alarm_boundary_and_suspect_values_do_not_feed_the_ema():
    detector = warmed_v3(1.0)
    thr1, thr2 = detector.thresholds()
    assert thr1 == pytest.approx(1e6) and thr2 == pytest.approx(100)
    state = (detector.avg, detector.n)
    verdict = detector.check(thr2 * 1.5)  # suspect: no alarm, no EMA update, pre_val follows
    assert (verdict.level, verdict.reason) == (0, "suspect")
    assert (detector.avg, detector.n) == state and detector.pre_val == thr2 * 1.5 and detector.suspect_total == 1
    assert detector.check(thr2).level == 0 and detector.n == 11  # equal to thr2: clean, absorbed
    thr1, _ = detector.thresholds()
    assert detector.check(thr1).level == 0  # equal to thr1: not greater (suspect)
    detector = warmed_v3(1.0)
    thr1, _ = detector.thresholds()
    verdict = detector.check(thr1 * 1.01)
    assert (verdict.level, verdict.reason) == (1, "markov")
    assert verdict.thresholds["thr1"] == pytest.approx(thr1)


def test_v3_needs_a_jump_larger_than_thr1_and_keeps_alarming_on_a_persistent_fault():
    detector = warmed_v3(1.0)
    thr1, _ = detector.thresholds()
    detector.check(0.9 * thr1)  # suspect; becomes pre_val
    assert detector.check(1.5 * thr1).level == 0  # above thr1, but only 0.6 * thr1 above pre_val
    detector = warmed_v3(1.0)
    assert detector.check(5 * thr1).level == 1
    assert detector.pre_val == 1.0  # an alarmed value is not pre_val
    assert detector.check(5 * thr1).level == 1  # the same fault again: alarms again


def test_v3_nan_inf_always_alarm_and_never_update():
    for bad in (NAN, INF):
        detector = warmed_v3(2.0)
        before = detector.state_dict()
        assert detector.check(bad).level == 1
        assert detector.state_dict() == before
    zeros = warmed_v3(0.0)
    assert zeros.thresholds() is None and zeros.check(5.0).level == 0  # a zero mean gives no bound
    assert zeros.check(NAN).level == 1


def test_v3_has_no_level_2():
    detector = warmed_v3(1.0)
    assert [detector.check(v).level for v in [50, 150, 1e5, 1e9]] == [0, 0, 0, 1]


# ------------------------------------------------------------------------- detector over points
def test_sdc_detector_points_skip_not_checked_and_report_detections():
    detector = SdcDetector("v1", ["a", "b"])
    for _ in range(7):
        assert detector.detect([1.0, 2.0], step=1) == []
    found = detector.detect([NOT_CHECKED, 3e6], step=8)
    assert found == [Detection("b", 1, 3e6, {"upper": 1e6, "sigma": 1e5}, "v1", "upper", found[0].state)]
    assert detector.point("a").count == 7  # skipped, not judged
    assert detector.detect([NAN, 1.0], step=9)[0].point == "a"
    assert detector.detections_total == 2
    with pytest.raises(ValueError, match="3 values for 2 detection points"):
        detector.detect([1.0, 1.0, 1.0], step=10)
    # names can grow (a tensor point declared on the first forward)
    assert detector.detect([1.0, 2.0, NAN], step=10, names=["a", "b", "c"])[0].point == "c"


def test_sdc_detector_from_config_uses_the_rule_and_thresholds():
    detector = SdcDetector.from_config(SdcConfig(rule="v1", upper=(500, 100), sigma=(50, 10)), ["x"])
    assert detector.detect([150.0], step=1)[0].level == 2
    assert SdcDetector.from_config(SdcConfig(rule="v3")).statistic == "max_sq"
    assert SdcDetector.from_config(SdcConfig()).statistic == "l2"


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_detector_state_survives_a_weights_only_checkpoint(rule):
    rng = np.random.default_rng(0)
    values = np.exp(rng.normal(0, 0.3, size=(40, 3))).tolist()
    a = SdcDetector(rule, ["p0", "p1", "p2"])
    for step, row in enumerate(values[:20]):
        a.detect(row, step)
    b = SdcDetector(rule, ["p0", "p1", "p2"])
    b.load_state_dict(roundtrip(a.state_dict()))
    assert b.state_dict() == a.state_dict()
    for step, row in enumerate(values[20:] + [[NAN, 1e30, 1.0]], start=20):
        assert a.detect(row, step) == b.detect(row, step)
    assert a.state_dict() == b.state_dict()


def test_detector_state_of_the_other_rule_is_ignored_and_malformed_state_refused(caplog):
    v1 = SdcDetector("v1", ["a"])
    v1.detect([1.0], 1)
    v3 = SdcDetector("v3", ["a"])
    with caplog.at_level(logging.WARNING):
        v3.load_state_dict(v1.state_dict())
    assert v3.points == {} and "start afresh" in caplog.text
    for bad in ({}, {"version": 2}, {**v1.state_dict(), "points": {"a": {"pre_val": "x"}}},
                {**v1.state_dict(), "points": {"a": {"pre_val": NAN, "min_val": 0, "max_val": 0, "count": 1}}},
                {**v1.state_dict(), "detections_total": -1}):
        with pytest.raises(CheckpointError, match="sdc detector state is malformed"):
            SdcDetector("v1").load_state_dict(bad)


# ------------------------------------------------------------------------------- the ratio criterion
def ratio_sequences():
    """The sequences the rules are tested on: stationary, wandering, shrinking and faulty ones."""
    rng = np.random.default_rng(7)
    sequences = [magnitudes(seed, 300, mu, sigma) for seed, mu, sigma in ((0, 0.0, 0.02), (1, -3.0, 0.1), (2, 2.0, 0.3))]
    sequences.append(np.exp(np.cumsum(rng.normal(-0.01, 0.2, size=300))).tolist())  # shrinking random walk
    faulty = magnitudes(3, 300, 0.0, 0.05)
    for i in (30, 100, 101, 102, 200):
        faulty[i] *= (50.0, 2.0**16, 2.0**16, 2.0**16, math.inf)[(30, 100, 101, 102, 200).index(i)]
    sequences.append(faulty)
    sequences.append([1, 2, 1, 2, 1, 2, 1, 500, 5000, 1e5, 2e6, NAN, 1.0, 0.0])
    return sequences


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_ratio_off_leaves_the_rules_verdicts_and_state_unchanged(rule):
    for sequence in ratio_sequences():
        stats = [statistic(rule, m) for m in sequence]
        plain = V1Detector() if rule == "v1" else V3Detector()
        off = SdcDetector(rule, ["p"], ratio=0.0)
        huge = SdcDetector(rule, ["p"], ratio=1e150)  # on, but never reached: the rule's verdicts alone
        for step, value in enumerate(stats):
            verdict = plain.check(value)
            assert [(d.level, d.reason, d.thresholds, d.state) for d in off.detect([value], step)] == (
                [(verdict.level, verdict.reason, verdict.thresholds, verdict.state)] if verdict.level else [])
            assert [(d.level, d.reason, d.thresholds) for d in huge.detect([value], step)] == (
                [(verdict.level, verdict.reason, verdict.thresholds)] if verdict.level else [])
            assert off.point("p").state_dict() == plain.state_dict()  # no "recent" while off
            assert {k: v for k, v in huge.point("p").state_dict().items() if k != "recent"} == plain.state_dict()


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_ratio_catches_a_x50_jump_after_the_warm_up_that_the_rule_alone_misses(rule):
    warm = 7 if rule == "v1" else 10
    clean = [1.0, 1.2, 0.9, 1.1] * 5
    for ratio in (0.0, 10.0):
        detector = SdcDetector(rule, ["p"], ratio=ratio)
        # during the warm-up a x50 value is judged by the rule alone (and absorbed)
        for step, m in enumerate(clean[:warm - 1] + [50.0] + clean):
            assert detector.detect([statistic(rule, m)], step) == []
        found = detector.detect([statistic(rule, 50.0 * 1.2)], 99)
        if not ratio:
            assert found == []  # the rule alone: v1's jump 59/spread < 5000, v3 only suspect (< 1e6 avg)
            continue
        assert [(d.level, d.reason) for d in found] == [(1, "ratio")]
        baseline = statistic(rule, 1.2)  # max of the last 16 clean values (the warm-up's 50 has left it)
        assert found[0].thresholds["ratio"] == 10.0 and found[0].thresholds["baseline"] == baseline
        assert found[0].thresholds["limit"] == pytest.approx(baseline * (10.0 if rule == "v1" else 100.0))
        assert found[0].state["ratio_baseline"] == baseline
        assert ABNORMAL in format_detection(found[0], 99, 0, "h", 0) and "(ratio)" in format_detection(found[0], 99, 0, "h", 0)


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_ratio_is_in_gradient_units_and_its_boundary_is_strict(rule):
    detector = V1Detector(ratio=10.0) if rule == "v1" else V3Detector(ratio=10.0)
    for m in [1.0, 2.0] * 6:
        assert detector.check(statistic(rule, m)).level == 0
    limit = 20.0 if rule == "v1" else 400.0  # 10 x max(recent) of the gradient: 10 * 2 (v3: (10 * 2)²)
    assert detector.check(limit).level == 0  # at the limit: clean, and absorbed
    assert detector.check(math.nextafter(limit * 10 if rule == "v1" else limit * 100, math.inf)).reason == "ratio"


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_ratio_alarmed_values_never_enter_the_baseline_nor_the_rules_state(rule):
    detector = V1Detector(ratio=10.0) if rule == "v1" else V3Detector(ratio=10.0)
    for m in [1.0, 1.1] * 10:
        detector.check(statistic(rule, m))
    before = detector.state_dict()
    assert before["recent"] == [statistic(rule, m) for m in [1.0, 1.1] * 8]
    for _ in range(5):  # a persistent x100 fault keeps alarming: it never becomes the baseline
        verdict = detector.check(statistic(rule, 110.0))
        assert (verdict.level, verdict.reason) == (1, "ratio")
        assert detector.state_dict() == before
    detector.check(statistic(rule, 1.05))
    assert detector.state_dict()["recent"][-1] == statistic(rule, 1.05) and len(detector.state_dict()["recent"]) == 16
    assert detector.check(NAN).reason == "non-finite"  # non-finite stays the rule's, never absorbed


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_ratio_state_survives_a_weights_only_checkpoint(rule):
    rng = np.random.default_rng(1)
    values = np.exp(rng.normal(0, 0.3, size=(40, 2))).tolist()
    values[30][0] *= 1e3
    a = SdcDetector(rule, ["p0", "p1"], ratio=10.0)
    for step, row in enumerate(values[:25]):
        a.detect(row, step)
    saved = roundtrip(a.state_dict())
    assert len(saved["points"]["p0"]["recent"]) == 16
    b = SdcDetector(rule, ["p0", "p1"], ratio=10.0)
    b.load_state_dict(saved)
    assert b.state_dict() == a.state_dict()
    for step, row in enumerate(values[25:], start=25):
        assert a.detect(row, step) == b.detect(row, step)
    assert a.detections_total >= 1 and a.state_dict() == b.state_dict()
    # a state saved with the criterion off loads (the baseline refills); ratio off drops a saved baseline
    c = SdcDetector(rule, ["p0", "p1"], ratio=10.0)
    c.load_state_dict(roundtrip(SdcDetector(rule, ["p0", "p1"]).state_dict()))
    point = c.point("p0")
    point.load_state_dict({**a.point("p0").state_dict(), "recent": [1.0] * 3})  # past the warm-up, short baseline
    assert point.ratio_bound(True) is None  # waits for the warm-up's number of values
    point.recent = [1.0] * (7 if rule == "v1" else 10)
    assert point.ratio_bound(True) is not None
    off = SdcDetector(rule, ["p0", "p1"])
    off.load_state_dict(saved)
    assert "recent" not in off.state_dict()["points"]["p0"]
    for bad in ("x", [1.0, "x"], [NAN], [1.0] * 17):
        broken = roundtrip(a.state_dict())
        broken["points"]["p0"]["recent"] = bad
        with pytest.raises(CheckpointError, match="sdc detector state is malformed"):
            SdcDetector(rule, ["p0"], ratio=10.0).load_state_dict(broken)


# -------------------------------------------------------------------------------- the peak criterion
@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_peak_catches_a_one_element_jump_that_the_rule_alone_misses_even_after_a_clean_spike(rule):
    """The benchmark's hard case: a clean x100 spike lifted every max-based baseline; a later x30 jump
    of the point, carried by one element (share ~1), is still level 1 by the peak criterion."""
    warm = 7 if rule == "v1" else 10
    clean = [1.0, 1.2, 0.9, 1.1] * 4
    history = clean[:warm] + [100.0] + clean  # the clean spike (share 0.1: spread over many elements)
    for peak in (0.0, 0.5):
        detector = SdcDetector(rule, ["p"], peak=peak)
        for step, m in enumerate(history):
            assert detector.detect([statistic(rule, m)], step, shares=[0.1]) == []
        found = detector.detect([statistic(rule, 30.0)], 99, shares=[0.999])
        if not peak:
            assert found == []  # the rule alone: v1's jump 29/spread < 5000, v3 below 1e6 avg
            continue
        assert [(d.level, d.reason) for d in found] == [(1, "peak")]
        # the median of the last 16 clean values (the spike left no trace): between 1.0 and 1.1
        median = (statistic(rule, 1.0) + statistic(rule, 1.1)) / 2
        assert found[0].thresholds["peak"] == 0.5
        assert found[0].thresholds["median"] == pytest.approx(median)
        assert found[0].thresholds["limit"] == pytest.approx(median * (4.0 if rule == "v1" else 16.0))
        assert found[0].state["share"] == 0.999
        assert "(peak)" in format_detection(found[0], 99, 0, "h", 0)
        # the same jump spread over many elements (a real spike) is the rule's to judge: not peak
        assert detector.detect([statistic(rule, 30.0)], 100, shares=[0.2]) == []


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_peak_needs_both_the_share_and_the_jump_and_waits_for_the_warm_up(rule):
    warm = 7 if rule == "v1" else 10
    detector = V1Detector(peak=0.5) if rule == "v1" else V3Detector(peak=0.5)
    for _ in range(warm - 1):  # a point whose gradient is always one element: share 1 and no jump
        assert detector.check(statistic(rule, 1.0), 1.0).level == 0
    assert detector.check(statistic(rule, 20.0), 1.0).level == 0  # still in the warm-up: absorbed
    for _ in range(16):
        assert detector.check(statistic(rule, 1.0), 1.0).level == 0  # share 1, no jump: quiet
    assert detector.check(statistic(rule, 4.0), 1.0).level == 0  # at the jump limit: not above it
    assert detector.check(statistic(rule, 4.5), 1.0).reason == "peak"
    assert detector.check(statistic(rule, 4.5), 0.5).level == 0  # at the share limit: not above it
    assert detector.check(statistic(rule, 4.5), None).level == 0  # no share given: the criterion is silent


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_peak_off_leaves_the_rules_verdicts_and_state_unchanged_and_its_state_round_trips(rule):
    for sequence in ratio_sequences():
        stats = [statistic(rule, m) for m in sequence]
        plain = V1Detector() if rule == "v1" else V3Detector()
        off = SdcDetector(rule, ["p"])
        for step, value in enumerate(stats):
            verdict = plain.check(value)
            assert [(d.level, d.reason) for d in off.detect([value], step, shares=[1.0])] == (
                [(verdict.level, verdict.reason)] if verdict.level else [])
            assert off.point("p").state_dict() == plain.state_dict()
    a = SdcDetector(rule, ["p"], peak=0.5)
    values = [statistic(rule, m) for m in magnitudes(5, 40, 0.0, 0.3)]
    for step, value in enumerate(values[:25]):
        a.detect([value], step, shares=[0.05])
    b = SdcDetector(rule, ["p"], peak=0.5)
    b.load_state_dict(roundtrip(a.state_dict()))
    assert len(b.point("p").recent) == 16 and b.state_dict() == a.state_dict()
    for step, value in enumerate(values[25:], start=25):
        assert a.detect([value * 50], step, shares=[0.99]) == b.detect([value * 50], step, shares=[0.99]) != []


def test_peak_config_key_and_from_config():
    assert SdcConfig().peak == 0.5  # on by default
    config = SdcConfig(rule="v3", peak=0.25)
    config.validate()
    assert SdcDetector.from_config(config, ["x"]).point("x").peak == 0.25
    off = SdcConfig(peak=0)
    off.validate()
    assert SdcDetector.from_config(off, ["x"]).point("x").peak == 0.0
    for bad in (1, 1.5, -0.1, math.nan, True, "0.5"):
        with pytest.raises(ConfigError, match=r"guards\.sdc\.peak must be 0 \(off\) or a share between 0 and 1"):
            SdcConfig(peak=bad).validate()
    with pytest.raises(ValueError, match="peak must be 0"):
        SdcDetector("v1", peak=2.0)


# --------------------------------------------------------------------------------- the row criterion
@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_row_catches_a_row_odds_jump_with_an_unremarkable_value_and_never_absorbs_it(rule):
    """A flip in a layer's output gradient, seen in its weight's gradient: the value rises only x3 (no
    rule, no peak), but one row now carries the energy: level 1, reason "row"."""
    warm = 7 if rule == "v1" else 10
    detector = SdcDetector(rule, ["w", "b"], peak=0.5, row_jump=100.0)
    clean = magnitudes(4, 30, 0.0, 0.2)
    for step, m in enumerate(clean):
        odds = 0.2 + 0.1 * (step % 3)  # 0.2, 0.3, 0.4: median 0.3 over the last 16
        assert detector.detect([statistic(rule, m)] * 2, step, shares=[0.01, 0.01], rows=[odds, NOT_CHECKED]) == []
    before = detector.point("w").state_dict()
    found = detector.detect([statistic(rule, 3.0)] * 2, 99, shares=[0.05, 0.05], rows=[500.0, NOT_CHECKED])
    assert [(d.point, d.level, d.reason) for d in found] == [("w", 1, "row")]
    assert found[0].thresholds["row_median"] == pytest.approx(0.3)
    assert found[0].thresholds["row_jump"] == 100.0 and found[0].thresholds["row_floor"] == 10.0
    assert found[0].state["row_odds"] == 500.0
    assert "(row)" in format_detection(found[0], 99, 0, "h", 0)
    assert detector.point("w").state_dict() == before  # neither the rule's state nor recent_rows took it
    assert warm <= len(clean)


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_row_needs_the_floor_and_the_jump_and_waits_for_the_warm_up(rule):
    warm = 7 if rule == "v1" else 10
    detector = V1Detector(row_jump=100.0) if rule == "v1" else V3Detector(row_jump=100.0)
    for _ in range(warm - 1):
        assert detector.check(statistic(rule, 1.0), None, 0.05).level == 0
    assert detector.check(statistic(rule, 1.0), None, 1000.0).level == 0  # still in the warm-up: absorbed
    for _ in range(16):
        assert detector.check(statistic(rule, 1.0), None, 0.05).level == 0
    assert detector.check(statistic(rule, 1.0), None, 9.0).level == 0  # x180 the median, under the floor
    assert detector.check(statistic(rule, 1.0), None, 5.0).level == 0  # exactly x100: not above it
    assert detector.check(statistic(rule, 1.0), None, 10.0).level == 0  # at the floor: not above it
    assert detector.check(statistic(rule, 1.0), None, 10.5).reason == "row"
    assert detector.check(statistic(rule, 1.0), None, None).level == 0  # no row odds: the criterion is silent
    always = V1Detector(row_jump=100.0) if rule == "v1" else V3Detector(row_jump=100.0)
    for _ in range(30):  # a matrix whose gradient always sits in one row: odds high, no jump, quiet
        assert always.check(statistic(rule, 1.0), None, 1e4).level == 0
    sometimes = V1Detector(row_jump=100.0) if rule == "v1" else V3Detector(row_jump=100.0)
    for step in range(60):  # a gradient that is all zeros two steps in three (an expert without tokens)
        odds = 12.0 if step % 3 == 2 else 0.0  # its odds when it has some: above the floor, no jump
        assert sometimes.check(statistic(rule, 1.0), None, odds).level == 0
    assert 0.0 not in sometimes.recent_rows


def warmed_row_point(rule: str, **kwargs) -> SdcDetector:
    detector = SdcDetector(rule, ["w"], peak=0.5, row_jump=100.0, **kwargs)
    for step, m in enumerate(magnitudes(7, 30, 0.0, 0.1)):
        odds = 0.2 + 0.1 * (step % 3)  # median 0.3
        assert detector.detect([statistic(rule, m)], step, shares=[0.01], rows=[odds]) == []
    return detector


def test_row_joint_test_needs_a_row_odds_jump_and_a_value_jump_together():
    """A flip of the order of the layer's whole gradient: row odds x25 their median (under the floor of
    10 and under x100) with the L2 norm x5: level 1, reason "row", by the joint test alone; either jump
    alone, or odds that stay under the joint floor of 1, is clean."""
    median = statistics.median(warmed_row_point("v1").point("w").recent)
    cases = {  # (row odds, value over the median of recent values) -> alarmed
        (7.5, 5.0): True,  # x25 and x5
        (7.5, 3.9): False,  # the value under x4
        (5.7, 5.0): False,  # x19 the odds' median
        (9.0, 60.0): True,  # a larger flip: still under the floor of 10, still the joint test's
    }
    for (odds, jump), alarmed in cases.items():
        detector = warmed_row_point("v1")
        before = detector.point("w").state_dict()
        found = detector.detect([median * jump], 30, shares=[0.01], rows=[odds])
        assert [(d.level, d.reason) for d in found] == ([(1, "row")] if alarmed else []), (odds, jump)
        if alarmed:
            assert found[0].thresholds["row_joint"] == 20.0
            assert found[0].thresholds["value_limit"] == pytest.approx(median * 4.0)
            assert detector.point("w").state_dict() == before  # not absorbed
    low = SdcDetector("v1", ["w"], peak=0.5, row_jump=100.0)
    for step, m in enumerate(magnitudes(7, 30, 0.0, 0.1)):
        assert low.detect([m], step, shares=[0.01], rows=[0.01]) == []
    assert low.detect([10.0], 30, shares=[0.01], rows=[0.9]) == []  # x90, under the joint floor
    assert low.detect([10.0], 31, shares=[0.01], rows=[1.1]) != []  # x110 and over 1
    off = warmed_row_point("v1", row_joint=0.0)
    assert off.detect([median * 60.0], 30, shares=[0.01], rows=[9.0]) == []
    with pytest.raises(ValueError, match="row_joint"):
        SdcDetector("v1", ["w"], row_jump=100.0, row_joint=0.5)


def test_row_joint_test_is_v1s_alone():
    """v3's statistic (the largest element squared) jumps with the row odds on clean steps: no joint test."""
    detector = warmed_row_point("v3")
    median = statistics.median(detector.point("w").recent)
    assert detector.point("w").row_joint == 0.0 and not detector.point("w").joint_test
    assert detector.detect([median * 3600.0], 30, shares=[0.01], rows=[9.0]) == []  # x60 in gradient units


def test_row_joint_test_keeps_the_values_window_without_the_peak_criterion():
    detector = SdcDetector("v1", ["w"], row_jump=100.0)  # peak off: recent values kept for the joint test
    for step in range(30):
        assert detector.detect([1.0], step, rows=[0.3]) == []
    assert len(detector.point("w").recent) == 16
    assert [d.reason for d in detector.detect([5.0], 30, rows=[7.5])] == ["row"]
    plain = SdcDetector("v1", ["w"], row_jump=100.0, row_joint=0.0)
    plain.detect([1.0], 0, rows=[0.3])
    assert plain.point("w").recent == [] and "recent" not in plain.point("w").state_dict()


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_a_lower_row_floor_is_the_only_difference_between_two_detectors(rule):
    default = SdcDetector(rule, ["w"], row_jump=50.0)
    lower = SdcDetector(rule, ["w"], row_jump=50.0, row_floor=3.0)
    for step in range(30):
        for detector in (default, lower):
            assert detector.detect([statistic(rule, 1.0)], step, rows=[0.1]) == []
    assert default.detect([statistic(rule, 1.0)], 30, rows=[9.6]) == []  # x96 the median, under the floor of 10
    found = lower.detect([statistic(rule, 1.0)], 30, rows=[9.6])
    assert [(d.reason, d.thresholds["row_floor"]) for d in found] == [("row", 3.0)]
    assert lower.detect([statistic(rule, 1.0)], 31, rows=[4.9]) == []  # above the floor, x49 the median
    for floor in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="row_floor"):
            SdcDetector(rule, ["w"], row_jump=50.0, row_floor=floor)


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_row_off_leaves_the_verdicts_and_state_unchanged_and_its_state_round_trips(rule):
    for sequence in ratio_sequences():
        stats = [statistic(rule, m) for m in sequence]
        plain = SdcDetector(rule, ["p"], peak=0.5)
        off = SdcDetector(rule, ["p"], peak=0.5, row_jump=0.0)
        for step, value in enumerate(stats):
            assert off.detect([value], step, shares=[0.01], rows=[1e6 * (step % 2)]) == plain.detect(
                [value], step, shares=[0.01])
        assert off.state_dict() == plain.state_dict() and "recent_rows" not in off.state_dict()["points"]["p"]
    a = SdcDetector(rule, ["p"], row_jump=100.0)
    for step, m in enumerate(magnitudes(5, 25, 0.0, 0.2)):
        a.detect([statistic(rule, m)], step, rows=[0.1 + 0.01 * step])
    b = SdcDetector(rule, ["p"], row_jump=100.0)
    b.load_state_dict(roundtrip(a.state_dict()))
    assert len(b.point("p").recent_rows) == 16 and b.state_dict() == a.state_dict()
    assert a.detect([statistic(rule, 1.0)], 30, rows=[50.0]) == b.detect([statistic(rule, 1.0)], 30, rows=[50.0]) != []
    older = roundtrip(a.state_dict())
    del older["points"]["p"]["recent_rows"]  # a state saved before the criterion: the odds refill
    c = SdcDetector(rule, ["p"], row_jump=100.0)
    c.load_state_dict(older)
    assert c.point("p").recent_rows == [] and c.detect([statistic(rule, 1.0)], 31, rows=[50.0]) == []
    for bad in ("x", [1.0, "x"], [NAN], [1.0] * 17):
        broken = roundtrip(a.state_dict())
        broken["points"]["p"]["recent_rows"] = bad
        with pytest.raises(CheckpointError, match="sdc detector state is malformed"):
            SdcDetector(rule, ["p"], row_jump=100.0).load_state_dict(broken)


@pytest.mark.parametrize("key, default", [("row_jump", 100.0), ("ratio", 0.0)])
def test_ratio_and_row_jump_config_keys_and_from_config(key, default):
    assert getattr(SdcConfig(), key) == default  # the row criterion is on by default, the ratio one off
    config = SdcConfig(rule="v3", **{key: 300})
    config.validate()
    assert getattr(config, key) == 300.0 and isinstance(getattr(config, key), float)
    assert getattr(SdcDetector.from_config(config, ["x"]).point("x"), key) == 300.0
    off = SdcConfig(**{key: 0})
    off.validate()
    assert getattr(SdcDetector.from_config(off, ["x"]).point("x"), key) == 0.0
    for bad in (1, 0.5, -2, math.inf, math.nan, True, "100"):
        with pytest.raises(ConfigError, match=rf"guards\.sdc\.{key} must be 0 \(off\) or a finite number > 1"):
            SdcConfig(**{key: bad}).validate()
        if not isinstance(bad, (bool, str)):
            with pytest.raises(ValueError, match=f"{key} must be 0"):
                SdcDetector("v1", **{key: bad})


# ------------------------------------------------------------------------------------ log lines
def test_level_1_line_is_an_error_with_the_reference_keyword_and_every_field():
    detection = Detection("model.layers.0.input_layernorm", 1, 3.5e9, {"upper": 1e6, "sigma": 1e5}, "v1", "upper",
                          {"pre_val": 1.0, "min_val": 0.5, "max_val": 2.0, "count": 9})
    line = format_detection(detection, step=120, rank=3, host="node07", device="cuda:3")
    assert ABNORMAL == "accuracy sensitivity feature abnormal"
    assert line.startswith("accuracy sensitivity feature abnormal: step 120, rank 3, host node07, local device cuda:3, ")
    for part in ("detection point model.layers.0.input_layernorm", "value 3.500000e+09", "rule v1 level 1 (upper)",
                 "thresholds: upper=1000000, sigma=100000", "state: pre_val=1.000000e+00, min_val=5.000000e-01",
                 "count=9"):
        assert part in line
    assert "\n" not in line and detection.log_level == logging.ERROR


def test_level_2_line_is_a_warning_without_the_abnormal_keyword():
    detection = Detection("p", 2, 12345.0, {"upper": 10000.0, "sigma": 5000.0}, "v1", "upper")
    line = format_detection(detection, 7, 0, "h", 0)
    assert line.startswith("accuracy sensitivity feature warning: step 7, rank 0, host h, local device 0, ")
    assert ABNORMAL not in line and detection.log_level == logging.WARNING
    nan = format_detection(Detection("p", 1, NAN, {"thr1": 1e6, "thr2": 100.0, "a1": 1e6, "a2": 100.0}, "v3",
                                     "non-finite"), 1, 0, "h", "cpu")
    assert "value nan" in nan and "rule v3 level 1 (non-finite)" in nan


def test_severity_orders_the_verdict_for_a_max_all_reduce():
    warning = Detection("p", 2, 1.0, {}, "v1")
    abnormal = Detection("q", 1, 1.0, {}, "v1")
    assert [severity([]), severity([warning]), severity([warning, abnormal]), severity([abnormal])] == [0, 1, 2, 2]


def test_values_line_of_level_3_leaves_out_points_not_checked():
    line = format_values(5, 1, "h", "cuda:1", ["a", "b", "c"], [1.0, NOT_CHECKED, NAN])
    assert line == "accuracy sensitivity feature values: step 5, rank 1, host h, local device cuda:1: a=1.000000e+00, c=nan"


# ------------------------------------------------------------------------------- switches, env
def test_defaults_and_level_properties():
    config = SdcConfig()
    config.validate()
    assert (config.enabled_level, config.rule, config.upper, config.sigma) == (0, "v1", (1000000, 10000), (100000, 5000))
    assert (config.rerun, config.strikes, config.strike_window_hours, config.points) == (True, 3, 8.0, [])
    assert [(SdcConfig(enabled_level=i).enabled, SdcConfig(enabled_level=i).recover,
             SdcConfig(enabled_level=i).log_values) for i in range(4)] == [
        (False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def test_environment_overrides_the_config_and_trainguard_names_win():
    base = SdcConfig(enabled_level=1, upper=(500, 100), points=["model.embed_tokens"])
    assert sdc_config_from_env(base, {}) == base
    env = {"NPU_ASD_ENABLE": "2", "NPU_ASD_UPPER_THRESH": "2000000,20000", "NPU_ASD_SIGMA_THRESH": " 300 , 40 "}
    config = sdc_config_from_env(base, env)
    assert (config.enabled_level, config.upper, config.sigma, config.points) == (2, (2000000, 20000), (300, 40),
                                                                                 ["model.embed_tokens"])
    assert base.enabled_level == 1 and base.upper == (500, 100)  # base untouched
    env.update(TRAINGUARD_SDC_ENABLE="3", TRAINGUARD_SDC_UPPER_THRESH="9,8", TRAINGUARD_SDC_SIGMA_THRESH="7,6")
    config = sdc_config_from_env(base, env)
    assert (config.enabled_level, config.upper, config.sigma) == (3, (9, 8), (7, 6))
    # blank is unset; only the variable in force is parsed
    config = sdc_config_from_env(base, {"TRAINGUARD_SDC_ENABLE": " ", "NPU_ASD_ENABLE": "0",
                                        "TRAINGUARD_SDC_SIGMA_THRESH": "10,5", "NPU_ASD_SIGMA_THRESH": "bad"})
    assert (config.enabled_level, config.sigma) == (0, (10, 5))


BAD_PAIRS = ["3", "3,3", "2,1", "a,b", "10,20", "-5,3", "10,-3", "1.5,1", "1e6,1e4", "1000000,10000,5", "5,",
             ",5", "5;3", "0x10,4", "+10,4"]


@pytest.mark.parametrize("variable", ["NPU_ASD_UPPER_THRESH", "NPU_ASD_SIGMA_THRESH", "TRAINGUARD_SDC_UPPER_THRESH",
                                      "TRAINGUARD_SDC_SIGMA_THRESH"])
@pytest.mark.parametrize("value", BAD_PAIRS)
def test_a_bad_threshold_pair_is_one_clear_error_naming_the_variable(variable, value):
    with pytest.raises(ConfigError) as info:
        sdc_config_from_env(SdcConfig(), {variable: value})
    message = str(info.value)
    assert variable in message and repr(value) in message and "\n" not in message
    assert "two integers >= 3, the first larger" in message


@pytest.mark.parametrize("variable", ["NPU_ASD_ENABLE", "TRAINGUARD_SDC_ENABLE"])
@pytest.mark.parametrize("value", ["4", "-1", "1.0", "yes", "true", "1,2", "01"])
def test_a_bad_enable_value_is_one_clear_error(variable, value):
    with pytest.raises(ConfigError, match=rf"environment variable {variable} must be 0, 1, 2 or 3, got {value!r}"):
        sdc_config_from_env(SdcConfig(), {variable: value})


def test_parse_pair_accepts_strings_and_sequences_from_yaml():
    assert parse_pair("1000000,10000", "x") == (1000000, 10000)
    assert parse_pair([1000000, 10000], "x") == (1000000, 10000)
    assert parse_pair((4, 3), "x") == (4, 3)
    for bad in ([3.0, 2.0], [True, 3], [5], (5, 4, 3), 7, None, [4, 4]):
        with pytest.raises(ConfigError, match="config key guards.sdc.upper"):
            parse_pair(bad, "config key guards.sdc.upper")


@pytest.mark.parametrize("changes, key", [
    ({"enabled_level": 4}, "enabled_level"), ({"enabled_level": True}, "enabled_level"),
    ({"rule": "v2"}, "rule"), ({"upper": (10, 20)}, "upper"), ({"sigma": "5"}, "sigma"),
    ({"rerun": 1}, "rerun"), ({"strikes": 0}, "strikes"), ({"strike_window_hours": 0}, "strike_window_hours"),
    ({"strike_window_hours": math.inf}, "strike_window_hours"), ({"points": "model.norm"}, "points"),
    ({"points": [""]}, "points"),
])
def test_config_validation_names_the_key(changes, key):
    with pytest.raises(ConfigError, match=rf"guards\.sdc\.{key}"):
        SdcConfig(**changes).validate()


def test_validate_normalises_yaml_lists_to_tuples():
    config = SdcConfig(upper=[2000, 1000], sigma=[30, 20], points=("a",))
    config.validate()
    assert (config.upper, config.sigma, config.points) == ((2000, 1000), (30, 20), ["a"])


# ------------------------------------------------------------------------------------ detection power
def magnitudes(seed: int, n: int, mu: float, sigma: float, clip: float = 4.0) -> list[float]:
    """A stationary, bounded lognormal gradient magnitude: exp(mu + sigma * clip(z, -4, 4))."""
    z = np.clip(np.random.default_rng(seed).standard_normal(n), -clip, clip)
    return np.exp(mu + sigma * z).tolist()


def statistic(rule: str, magnitude: float) -> float:
    # v1 judges an L2 norm (scales like the gradient), v3 max(g²) (like its square)
    return magnitude if rule == "v1" else magnitude * magnitude


def run_with_fault(detector, rule, clean, fault_magnitude):
    for step, m in enumerate(clean):
        assert detector.detect([statistic(rule, m)], step) == [], f"false alarm at clean check {step}"
    return detector.detect([statistic(rule, fault_magnitude)], len(clean))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(10, 300), mu=st.floats(-4, 4),
       sigma=st.floats(0.0, 0.02), victim=st.integers(0, 299))
def test_a_1e3_scaled_gradient_is_always_detected_after_warm_up(seed, n, mu, sigma, victim):
    """A gradient scaled by 1e3 (a bit-flip-like fault), checked after the warm-up, on a stationary
    process: v1 at its default thresholds (which needs the process' spread under ~20 % of its level:
    sigma <= 0.02 here), v3 with a1 = 1e4 (at its default a1 = 1e6 a 1e3x gradient only just reaches
    the bound: see the next test)."""
    clean = magnitudes(seed, n + 1, mu, sigma)
    fault = clean.pop(victim % (n + 1)) * 1e3
    assert run_with_fault(SdcDetector("v1", ["p"]), "v1", clean, fault)
    assert run_with_fault(SdcDetector("v3", ["p"], a1=1e4), "v3", clean, fault)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(10, 300), mu=st.floats(-4, 4),
       sigma=st.floats(0.0, 0.1), exponent=st.integers(16, 60))
def test_an_exponent_bit_flip_is_always_detected_at_the_defaults(seed, n, mu, sigma, exponent):
    """A gradient scaled by 2**16 or more (an exponent bit flipped in bf16/fp32) on a stationary
    process with up to ~50 % spread: both rules at their default thresholds, level 1 or 2."""
    clean = magnitudes(seed, n + 1, mu, sigma)
    fault = clean.pop() * 2.0**exponent
    for rule in ("v1", "v3"):
        found = run_with_fault(SdcDetector(rule, ["p"]), rule, clean, fault)
        assert found and found[0].level in (1, 2)
    assert run_with_fault(SdcDetector("v1", ["p"]), "v1", clean, math.nan)[0].level == 1
    assert run_with_fault(SdcDetector("v3", ["p"]), "v3", clean, math.inf)[0].level == 1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_no_detection_on_2000_clean_checks_at_the_default_thresholds(rule, seed):
    """A lognormal-ish stationary process (AR(1) in log space, ~40 % spread, slow wander) at 4 points."""
    rng = np.random.default_rng(seed)
    log = np.zeros(4)
    detector = SdcDetector(rule, ["a", "b", "c", "d"])
    for step in range(2000):
        log = 0.9 * log + rng.normal(0.0, 0.2, size=4)
        values = [statistic(rule, m) for m in np.exp(log + np.array([-3.0, 0.0, 2.0, 5.0]))]
        assert detector.detect(values, step) == [], f"false alarm at step {step}"
    assert detector.detections_total == 0


# -------------------------------------------------------------------------- rerun and strikes
def test_rerun_that_differs_is_transient_and_uses_the_rerun():
    book = StrikeBook()
    attribution = RerunAttribution(book, host="node07", device="cuda:3").on_detection(
        12, 3, {"layers.0.norm": 3e9}, {"layers.0.norm": 1.25, "layers.1.norm": 2.0}, now=1000.0)
    assert isinstance(attribution, Attribution)
    assert (attribution.kind, attribution.action, attribution.differing) == ("transient", "use_rerun", ("layers.0.norm",))
    assert (attribution.strikes, attribution.faulty) == (1, False)
    assert "transient fault" in attribution.message and "strike 1 of 3 within 8 h" in attribution.message


def test_rerun_that_is_bitwise_identical_is_reproducible_and_skipped():
    rerun = RerunAttribution(StrikeBook(), "h", 0)
    same = rerun.on_detection(5, 0, {"a": 3e9, "b": NAN}, {"a": 3e9, "b": NAN, "c": 1.0}, now=0.0)
    assert (same.kind, same.action, same.differing) == ("reproducible", "skip_step", ())
    close = rerun.on_detection(6, 0, [3e9], [math.nextafter(3e9, 0)], now=1.0)
    assert close.kind == "transient" and close.points == ("0",)  # one ulp is a difference
    missing = rerun.on_detection(7, 0, {"a": 1.0}, {}, now=2.0)
    assert missing.kind == "transient"  # the point did not fire on the rerun: not the same result
    unverified = rerun.on_detection(8, 0, {"a": 1.0}, None, now=3.0)
    assert (unverified.kind, unverified.action) == ("unverified", "skip_step")
    # only the two transient verdicts are strikes: a reproducible value (NaN included) is the data's
    assert (unverified.faulty, unverified.strikes) == (False, 2)
    assert "no strike" in same.message and "strike 2 of 3" in missing.message


def test_a_transient_fault_seen_only_at_reduced_gradients_strikes_no_one():
    book = StrikeBook()
    attribution = RerunAttribution(book, "h", "cuda:0").on_detection(3, 0, {"grad:w": 9e9}, {"grad:w": 1.0},
                                                                      now=0.0, local=False)
    assert (attribution.kind, attribution.action, attribution.strikes) == ("transient", "use_rerun", 0)


def test_reproducible_nan_never_makes_a_device_faulty():
    book = StrikeBook(strikes=3)
    rerun = RerunAttribution(book, "h", "cuda:0")
    for step in range(10):
        attribution = rerun.on_detection(step, 0, {"a": NAN}, {"a": NAN}, now=float(step))
        assert (attribution.kind, attribution.strikes, attribution.faulty) == ("reproducible", 0, False)
    assert book.faulty_entries() == [] and book.count("h", "cuda:0", now=10.0) == 0


def test_strikes_within_the_window_make_a_device_faulty():
    book = StrikeBook(strikes=3, window_hours=8)
    assert not book.record(0, "h", 0, 10, {"kind": "transient"}, now=0.0)
    assert not book.record(0, "h", 0, 20, {"kind": "transient"}, now=4 * HOUR)
    assert book.count("h", 0, now=4 * HOUR) == 2
    assert book.record(0, "h", 0, 30, {"kind": "reproducible"}, now=8 * HOUR)  # exactly 8 h after the first: in
    assert book.is_faulty("h", 0) and not book.is_faulty("h", 1)
    assert book.record(0, "h", 0, 40, {}, now=100 * HOUR)  # faulty for good


def test_strikes_spread_wider_than_the_window_never_add_up():
    book = StrikeBook(strikes=3, window_hours=8)
    for i in range(20):  # one strike every 4.01 hours: at most 2 within any 8 hours
        assert not book.record(1, "h", "cuda:1", i, {"kind": "transient"}, now=i * 4.01 * HOUR)
    assert len(book.state_dict()["devices"][0]["strikes"]) == 2  # older strikes are forgotten
    # devices are counted apart, even on one host
    for device in ("cuda:0", "cuda:2"):
        book.record(0, "h", device, 1, {}, now=0.0)
        book.record(0, "h", device, 2, {}, now=1.0)
    assert not book.is_faulty("h", "cuda:0") and book.faulty_entries() == []


def test_strike_book_state_survives_a_weights_only_checkpoint():
    book = StrikeBook(strikes=2, window_hours=1)
    book.record(3, "node07", "cuda:3", 5, {"kind": "transient", "first_values": {"a": NAN}}, now=10.0)
    book.record(3, "node07", "cuda:3", 9, {"kind": "reproducible", "points": ("a",)}, now=20.0)
    book.record(1, "node01", 1, 9, {"kind": "transient"}, now=20.0)
    restored = StrikeBook(strikes=2, window_hours=1)
    restored.load_state_dict(roundtrip(book.state_dict()))
    assert restored.state_dict() == book.state_dict()
    assert restored.is_faulty("node07", "cuda:3") and not restored.is_faulty("node01", 1)
    assert restored.record(1, "node01", 1, 10, {}, now=30.0)
    node07 = next(e for e in restored.faulty_entries() if e["host"] == "node07")
    assert node07["strikes"][0]["first_values"] == {"a": "nan"} and node07["strikes"][1]["points"] == ["a"]
    for bad in ({}, {"version": 1, "devices": [{"rank": 0}]},
                {"version": 1, "devices": [{"rank": 0, "host": "h", "local_device": 0, "strikes": [], "faulty": 1}]},
                {"version": 1, "devices": [{"rank": -1, "host": "h", "local_device": 0, "strikes": [], "faulty": False}]}):
        with pytest.raises(CheckpointError, match="sdc strike book state is malformed"):
            StrikeBook().load_state_dict(bad)


def test_faulty_ranks_json_is_written_atomically_and_merged(tmp_path):
    path = faulty_ranks_path(tmp_path)
    assert path == tmp_path / "faults" / "faulty_ranks.json" and read_faulty_ranks(path) == []
    book = StrikeBook(strikes=1)
    book.record(3, "node07", "cuda:3", 12, {"kind": "transient", "points": ["a"], "first_values": {"a": INF}}, now=5.0)
    written = write_faulty_ranks(path, book.faulty_entries())
    data = json.loads(path.read_text())  # strict JSON: no NaN/Infinity tokens
    assert data == written == [{"rank": 3, "host": "node07", "local_device": "cuda:3", "strikes": [
        {"step": 12, "rank": 3, "time": 5.0, "kind": "transient", "points": ["a"], "first_values": {"a": "inf"}}]}]
    other = StrikeBook(strikes=1)
    other.record(0, "node01", 0, 13, {"kind": "reproducible"}, now=6.0)
    book.record(4, "node07", "cuda:3", 14, {"kind": "transient"}, now=7.0)
    write_faulty_ranks(path, other.faulty_entries() + book.faulty_entries())
    entries = read_faulty_ranks(path)
    assert [(e["host"], e["local_device"], e["rank"], len(e["strikes"])) for e in entries] == [
        ("node07", "cuda:3", 4, 2), ("node01", 0, 0, 1)]
    assert [p.name for p in path.parent.iterdir()] == ["faulty_ranks.json"]  # no temp file left


def test_a_malformed_faulty_ranks_file_is_one_clear_error(tmp_path):
    path = tmp_path / "faulty_ranks.json"
    for text in ("{", "{}", '[{"rank": 0}]', '[{"rank": "0", "host": "h", "local_device": 0, "strikes": []}]'):
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"faulty_ranks\.json: malformed faulty ranks file"):
            read_faulty_ranks(path)


def test_faulty_device_error_exits_17():
    assert FaultyDeviceError("x").exit_code == EXIT_FAULTY_HARDWARE == 17


def _write_many(path: Path, host: str, barrier, rounds: int) -> None:
    barrier.wait()
    for strike in range(rounds):
        write_faulty_ranks(path, [{"rank": 0, "host": host, "local_device": 0,
                                   "strikes": [{"step": s, "rank": 0, "time": float(s), "kind": "transient"}
                                               for s in range(strike + 1)]}])


def test_concurrent_writers_of_faulty_ranks_json_lose_no_entry(tmp_path):
    """Ranks that reach their strike limit in the same step write the file at the same time."""
    import multiprocessing

    path = faulty_ranks_path(tmp_path)
    context = multiprocessing.get_context("fork")
    hosts = [f"node{i:02d}" for i in range(6)]
    barrier = context.Barrier(len(hosts))
    workers = [context.Process(target=_write_many, args=(path, host, barrier, 25)) for host in hosts]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    entries = {e["host"]: e for e in read_faulty_ranks(path)}
    assert sorted(entries) == hosts
    assert all(len(e["strikes"]) == 25 for e in entries.values())
    assert [p.name for p in path.parent.iterdir()] == ["faulty_ranks.json"]


# ------------------------------------------------------------------- a new layout: a fresh warm-up
@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_a_not_checked_share_or_row_never_enters_a_window(rule):
    """A shard too small for a peak share reports NOT_CHECKED; once the shard is whole (a resume on
    fewer ranks) its real share must be judged against real shares, not against a window of -1s
    (issue 39: every later share was a 100x jump over a median of -1, every step level 1)."""
    detector = SdcDetector(rule, ["p"], peak=0.5, row_jump=100.0)
    values = [statistic(rule, m) for m in magnitudes(11, 60, 0.0, 0.1)]
    for step, value in enumerate(values[:30]):
        assert detector.detect([value], step, shares=[NOT_CHECKED], rows=[NOT_CHECKED]) == []
    assert detector.point("p").recent_shares == [] and detector.point("p").recent_rows == []
    for step, value in enumerate(values[30:], start=30):
        assert detector.detect([value], step, shares=[0.01], rows=[0.5]) == [], step


@pytest.mark.parametrize("rule", ["v1", "v3"])
def test_a_point_whose_layout_changes_starts_a_fresh_warm_up_and_layouts_round_trip(rule):
    names = ["grad:w", "norm"]
    small, whole = ["world 2, [32, 64] of [64, 64]", "world 2"], ["world 1, [64, 64]", "world 1"]
    a = SdcDetector(rule, names, peak=0.5)
    for step, value in enumerate([statistic(rule, m) for m in magnitudes(3, 20, 0.0, 0.05)]):
        assert a.restart_changed(names, small) == []  # the first call records them: no history to drop
        a.detect([value, value], step, shares=[0.01, 0.01])
    b = SdcDetector(rule, names, peak=0.5)
    b.load_state_dict(roundtrip(a.state_dict()))
    assert b.restart_changed(names, small) == [] and b.state_dict() == a.state_dict()
    # the same checkpoint on one rank: what each point measured is gone, its warm-up starts again,
    # so a value 1000x the old ones is not judged against them
    assert b.restart_changed(names, whole) == names and b.points == {}
    assert b.detect([statistic(rule, 1000.0)] * 2, 20, shares=[0.9, 0.9]) == []
    assert b.layouts == dict(zip(names, whole))
    # a state saved before layouts were kept holds no layout: its points start afresh too
    older = {key: value for key, value in a.state_dict().items() if key != "layouts"}
    c = SdcDetector(rule, names, peak=0.5)
    c.load_state_dict(roundtrip(older))
    assert c.restart_changed(names, small) == names
    with pytest.raises(CheckpointError, match="layouts must be a mapping"):
        SdcDetector(rule, names).load_state_dict({**a.state_dict(), "layouts": {"grad:w": 3}})
    with pytest.raises(ValueError, match="1 layouts for 2 detection points"):
        a.restart_changed(names, small[:1])
