"""The detection rules: one scalar per detection point per step in, verdicts out. Pure logic, host floats.

v1 (Ascend ``SilentCheck``, the NPU_ASD_UPPER_THRESH / NPU_ASD_SIGMA_THRESH semantics)
    ``val`` is the L2 norm of the checked gradient. Per point: ``pre_val``, ``min_val``, ``max_val``,
    ``count``. With ``jump = (val - pre_val) / spread`` (only once ``count >= 7``):

    - level 1 if ``val`` is NaN/Inf, or ``val > upper[0]``, or ``jump > sigma[0]``;
    - else level 2 if ``val > upper[1]`` or ``jump > sigma[1]``;
    - else 0.

    ``spread = max(max_val - min_val, 1e-3 * max(|max_val|, |min_val|))``: a spread below 0.1 % of the
    values' magnitude counts as 0.1 %, so a (nearly) constant history does not divide by zero or turn
    rounding noise into jumps; when even that is 0 (every value so far was 0) the jump test is skipped.
    The jump is signed: a drop never alarms.

    State update: a finite value of level 0 or 2 is absorbed (``pre_val = val``, ``min_val``/``max_val``
    widened, ``count += 1``; the first absorbed value sets both ``min_val`` and ``max_val``). A level-1
    value (NaN/Inf included) is never absorbed: the step it came from is thrown away or rerun, and one
    corrupted value in ``max_val`` would blind the jump test for the rest of the run. (The reference
    absorbs level-1 values when it only logs them; we do not, in any mode.)

v3 (bias-corrected EMA, a Markov-inequality bound)
    ``val`` is ``max(g²)`` of the checked gradient. Per point: ``avg`` (EMA, starting at 0), ``n`` (clean
    values absorbed), ``pre_val``. NaN/Inf is always level 1. While ``n < 10`` every finite value is
    clean. Afterwards, with ``c = 1 - 0.99**n``, ``thr1 = avg * a1 / c`` and ``thr2 = avg * a2 / c``
    (``a1 = 1e6``, ``a2 = 100``):

    - level 1 if ``val > thr1`` and ``|val - pre_val| > thr1``;
    - suspect if ``val > thr2`` otherwise: no alarm, the EMA is not updated;
    - clean otherwise: ``avg = 0.99 * avg + 0.01 * val``, ``n += 1``.

    ``pre_val`` is the last finite value that was not a level-1 alarm (clean or suspect). So a ramp
    through the suspect band into the alarm band does not alarm unless its last step is itself a jump
    larger than ``thr1``, while a persistent fault keeps alarming at every step. While ``avg`` is 0
    (every clean value so far was 0) there is no bound: only NaN/Inf alarm. v3 has no level 2.

ratio (trainguard's criterion, off by default: ``guards.sdc.ratio``; applies on top of either rule)
    Per point: ``recent``, the last ``RATIO_WINDOW`` (16) values the point took as clean (every finite
    value that did not end up level 1: v1's level 0 and 2, v3's clean and suspect values); the
    baseline is ``max(recent)``. Once the rule's warm-up is over (v1 ``count >= 7``, v3 ``n >= 10``)
    and the baseline is > 0, a finite value that the rule did not already make level 1 is level 1
    with reason ``"ratio"`` when

    - v1 (L2 norm): ``val > ratio * baseline``;
    - v3 (max g²): ``val > ratio**2 * baseline``: the ratio is in gradient units for both rules, so
      the same ``ratio`` means the same growth of the gradient (``max(g²)`` grows as its square).

    Such a value is a level-1 alarm like any other: it does not enter ``recent`` nor the rule's
    state. Taking the max of the recent clean values (not the last one, not the whole run's spread)
    lets ordinary step-to-step noise and the shrinking of gradients during training through, while a
    sudden ×ratio jump over everything seen lately is caught. A legitimate, lasting growth by more
    than ``ratio`` keeps alarming (nothing alarmed enters the baseline), as a persistent fault does.
    After loading a state saved with the criterion off, it waits until ``recent`` holds the
    warm-up's number of values again. With ``ratio = 0`` (the default) nothing is tracked and v1/v3 behave exactly as described above.

peak (trainguard's criterion, on by default: ``guards.sdc.peak`` 0.5 in ``SdcConfig``; the classes here
default to 0; applies on top of either rule)
    The signature of a bit flip: one element blown up until it carries most of the point's gradient.
    Besides the rule's statistic, the point records its *peak share* ``max(g²) / Σg²`` (the largest
    element's share of the squared L2 norm; the largest over the micro-batches). An activation point
    (``DetectionPoints(shares=True)``) judges it against the element's own row, a token's features
    (``points.isolated_peak_share``): an element that is large because its whole token is counts for
    little, since clean activation gradients put most of their energy into one token at times; a
    weight matrix's gradient point takes it on its largest row when it records row odds
    (``points.matrix_statistics``). Once the rule's warm-up is over and ``recent`` (the same window of clean values as
    the ratio criterion's) holds the warm-up's number of values, a finite value that the rule did not
    already make level 1 is level 1 with reason ``"peak"`` when

    - its share is above ``peak``, and
    - the value is above ``PEAK_JUMP`` (4) times the median of ``recent`` (v3: 4² = 16 times);

    or, whatever the value (large points, where one element barely moves the norm), when the share is
    above ``PEAK_SHARE_FLOOR`` and over ``PEAK_SHARE_JUMP`` (100) times the median of the point's
    recent clean shares (``recent_shares``).

    A real gradient spike, even a ×300 one early in training, is spread over many elements (its share
    stays low: at most 0.17 over 4000 clean checks in ``benchmarks/sdc_detection.py``), while an
    exponent flip that multiplies one element by 2¹⁶ takes the share to 0.998 and more. The jump
    condition keeps a point whose gradient is always concentrated (a handful of elements) quiet; the
    median, not the max, keeps one earlier clean spike from lifting the baseline. Values it alarms do
    not enter ``recent`` nor the rule's state. With ``peak = 0`` nothing is recorded or tracked.

row (trainguard's criterion, on by default: ``guards.sdc.row_jump`` 100 in ``SdcConfig``; the classes here
default to 0; applies on top of either rule, to the points that get a row statistic: the gradients of
weight matrices, ``GradientPoints(rows=True)``)
    The signature of a flipped element of a layer's *output* gradient, seen in the layer's weight
    gradient: ``dW = Σ_t g_t x_tᵀ``, so a flipped ``g[t, j]`` adds ``flip · x_t`` to row ``j`` alone. The
    point records its *row odds*: the largest row's share of the squared L2 norm over the rest's,
    ``max_r |dW_r|² / (|dW|² − max_r |dW_r|²)``. Once the rule's warm-up is over and the point's recent
    clean row odds (``recent_rows``, the last ``RATIO_WINDOW``) hold the warm-up's number of values, a
    finite value that no other test made level 1 is level 1 with reason ``"row"`` when its row odds
    are above ``row_floor`` (``ROW_ODDS_FLOOR``, 10, unless given: one row carries over 10/11 of the
    energy) and above ``row_jump`` times the median of ``recent_rows``. The flip's energy, spread over
    a token's row in the activation gradients (where clean gradients also concentrate on one token at
    times, which is why no such test is run there), stays in one row of the weight gradient. Values it
    alarms do not enter ``recent_rows`` nor the rule's state. With ``row_jump = 0`` nothing is recorded
    or tracked.

    Its joint test (v1 only: ``row_joint``, ``ROW_JOINT_JUMP`` unless given; 0 turns it off): a flip
    that matters but is of the order of the whole layer's gradient raises the row odds tens of times,
    not a hundred, and the gradient's L2 norm a few times with them. A value is also level 1 with
    reason ``"row"`` when its row odds are above ``ROW_JOINT_FLOOR`` (1) and above ``row_joint`` (20)
    times the median of ``recent_rows`` *and* the value is above ``ROW_JOINT_VALUE`` (4) times the
    median of ``recent``. Clean steps move one of the two at a time: a gradient spike (high learning
    rate, garbage batches) spreads over the rows, and clean row odds that jumped more than 20x did so
    with the norm under 3x its median (``benchmarks/RESULTS.md``, session 13). Not v3's: its statistic,
    the largest element squared, jumped over 16x its median with the row odds over 20x on clean steps
    (9 false alarms in 395 640 clean checks of llama-micro and llama-tiny).

Checkpointing: ``state_dict()`` holds plain ints, floats, strings, lists and dicts (loads with
``torch.load(weights_only=True)``); the state is per rank (each rank sees its own gradients).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.errors import CheckpointError
from trainguard.guards.sdc.config import DEFAULT_SIGMA, DEFAULT_UPPER, RULES, SdcConfig

# collect()'s value for a point whose hook did not fire during the step; every statistic is >= 0 (or
# NaN), so a negative value is never a check
NOT_CHECKED = -1.0

V1_MIN_STEPS = 7
V1_SPREAD_FLOOR = 1e-3
V3_BETA = 0.99
V3_MIN_STEPS = 10
V3_A1 = 1e6
V3_A2 = 100.0
RATIO_WINDOW = 16  # clean values the ratio and peak baselines look back on (their max, their median)
PEAK_JUMP = 4.0  # the peak criterion's jump over the recent median, in gradient units (v3: squared)
PEAK_SHARE_JUMP = 100.0  # ... or the share's jump over the point's recent median share
PEAK_SHARE_FLOOR = 1e-3  # ... the share jump counts only above this share
ROW_ODDS_FLOOR = 10.0  # the row criterion: the largest row carries over 10x the energy of the others
ROW_JOINT_JUMP = 20.0  # the row criterion's joint test: row odds over 20x their median...
ROW_JOINT_VALUE = 4.0  # ... while the L2 norm is over 4x its recent median (v1's statistic)
ROW_JOINT_FLOOR = 1.0  # ... and the largest row outweighs all the others together

STATISTIC = {"v1": "l2", "v3": "max_sq"}  # the statistic each rule judges (DetectionPoints(statistic=...))


class SdcLevel(enum.IntEnum):
    """A value's level, the reference's numbers (in its log lines and in events)."""

    CLEAN = 0  # or suspect (v3)
    ABNORMAL = 1  # stops the step when guards.sdc.enabled_level >= 2
    WARNING = 2


class Severity(enum.IntEnum):
    """One rank's detections of a step, ordered so that the ranks agree by all-reducing it with MAX."""

    NOTHING = 0
    WARNINGS = 1  # level-2 detections only
    ABNORMAL = 2  # a level-1 detection: stop the step


LOG_LEVELS = {SdcLevel.ABNORMAL: logging.ERROR, SdcLevel.WARNING: logging.WARNING}
ABNORMAL = "accuracy sensitivity feature abnormal"  # the reference's keyword (level 1, ERROR)
WARNING_TEXT = "accuracy sensitivity feature warning"  # level 2, WARNING

_STATE_VERSION = 1


@dataclass(frozen=True)
class Verdict:
    """One point's judgement of one value."""

    level: SdcLevel
    reason: str  # "" | "non-finite" | "upper" | "jump" | "markov" | "ratio" | "peak" | "row" | "suspect" (level 0, v3)
    thresholds: dict[str, float]  # the thresholds of the level reported (level 0: those of level 2 for v1)
    state: dict[str, float]  # the state the value was judged against (v1 adds "jump" once it applies)


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _measured(ratio: float | None) -> float | None:
    """A peak share or row odds as the criteria take it: None for no measurement (absent, NaN/Inf, or
    ``NOT_CHECKED``: a shard too small for a share). Kept out of every window: a -1 in a point's recent
    shares made every later real share a 100x jump over their median (issue 39)."""
    return ratio if ratio is not None and math.isfinite(ratio) and ratio >= 0 else None


def _check_peak(peak: float) -> float:
    peak = float(peak)
    if not (peak == 0 or 0 < peak < 1):
        raise ValueError(f"peak must be 0 (off) or a share between 0 and 1, got {peak!r}")
    return peak


def _check_factor(name: str, factor: float) -> float:
    """``ratio`` and ``row_jump``: 0 (off) or a finite factor above 1."""
    factor = float(factor)
    if not math.isfinite(factor) or not (factor == 0 or factor > 1):
        raise ValueError(f"{name} must be 0 (off) or a finite number > 1, got {factor!r}")
    return factor


def _check_row_floor(floor: float) -> float:
    floor = float(floor)
    if not (math.isfinite(floor) and floor > 0):
        raise ValueError(f"row_floor must be a finite number > 0, got {floor!r}")
    return floor


class _RatioBaseline:
    """The ratio, peak and row criteria's per-point part: the recent clean values and the bounds they give."""

    ratio: float
    peak: float
    row_jump: float
    row_floor: float
    row_joint: float
    recent: list[float]
    recent_shares: list[float]
    recent_rows: list[float]
    min_steps: int
    exponent: int  # 1 for a statistic that scales like the gradient (l2), 2 for its square (max_sq)

    def _start_baselines(self, ratio: float, peak: float, row_jump: float, row_floor: float, row_joint: float) -> None:
        """The criteria's factors (validated) and empty windows of recent clean values."""
        self.ratio = _check_factor("ratio", ratio)
        self.peak = _check_peak(peak)
        self.row_jump = _check_factor("row_jump", row_jump)
        self.row_floor = _check_row_floor(row_floor)
        self.row_joint = _check_factor("row_joint", row_joint)
        self.recent = []
        self.recent_shares = []  # the peak criterion's: the point's recent clean peak shares
        self.recent_rows = []  # the row criterion's: the point's recent clean row odds

    def ratio_bound(self, warmed_up: bool) -> tuple[float, float] | None:
        """``(baseline, limit)`` when the criterion applies, else None."""
        # len(recent) >= min_steps: the same as the warm-up in a run, and a baseline of several values
        # after loading a state saved with the criterion off
        if self.ratio <= 0 or not warmed_up or len(self.recent) < min(self.min_steps, RATIO_WINDOW):
            return None
        baseline = max(self.recent)
        if baseline <= 0:
            return None
        return baseline, baseline * self.ratio ** self.exponent

    def ratio_thresholds(self, bound: tuple[float, float]) -> dict[str, float]:
        return {"ratio": self.ratio, "baseline": bound[0], "limit": bound[1]}

    @property
    def tracking(self) -> bool:
        """Whether the recent clean values are kept (the ratio or the peak criterion, or the row
        criterion's joint test, is on)."""
        return self.ratio > 0 or self.peak > 0 or self.joint_test

    def peak_verdict(self, value: float, share: float | None, warmed_up: bool,
                     state: dict[str, float]) -> dict[str, float] | None:
        """The peak criterion: its thresholds when ``value`` is level 1 by it, else None."""
        if self.peak <= 0 or share is None or not warmed_up:
            return None
        if len(self.recent) < min(self.min_steps, RATIO_WINDOW):
            return None
        median = _median(self.recent)
        limit = median * PEAK_JUMP ** self.exponent
        by_value = share > self.peak and median > 0 and value > limit
        # a large point: one blown-up element barely moves its norm, but its share jumps by orders of
        # magnitude over the point's usual share (which, for a point always concentrated, it cannot)
        enough = len(self.recent_shares) >= min(self.min_steps, RATIO_WINDOW)
        share_median = _median(self.recent_shares) if enough else None
        by_share = (share_median is not None and share > PEAK_SHARE_FLOOR
                    and share > PEAK_SHARE_JUMP * share_median)
        if share > self.peak or by_share:
            state["share"] = share
            state["peak_median"] = median
        if not (by_value or by_share):
            return None
        return {"peak": self.peak, "median": median, "limit": limit,
                **({"share_median": share_median} if share_median is not None else {})}

    @property
    def joint_test(self) -> bool:
        return self.row_jump > 0 and self.row_joint > 0

    def row_verdict(self, row: float | None, value: float, warmed_up: bool,
                    state: dict[str, float]) -> dict[str, float] | None:
        """The row criterion: its thresholds when the row odds ``row`` (with ``value``, for the joint
        test) make the value level 1, else None."""
        # an all-zero gradient (odds 0: an expert that got no tokens, a masked branch) is not a check
        if self.row_jump <= 0 or row is None or row <= 0 or not warmed_up:
            return None
        if len(self.recent_rows) < min(self.min_steps, RATIO_WINDOW):
            return None
        median = _median(self.recent_rows)
        thresholds = {"row_jump": self.row_jump, "row_median": median, "row_floor": self.row_floor}
        if not (row > self.row_floor and row > self.row_jump * median):
            if not (self.joint_test and row > ROW_JOINT_FLOOR and row > self.row_joint * median
                    and len(self.recent) >= min(self.min_steps, RATIO_WINDOW)):
                return None
            value_median = _median(self.recent)
            value_limit = value_median * ROW_JOINT_VALUE
            if not (value_median > 0 and value > value_limit):
                return None
            thresholds.update(row_joint=self.row_joint, value_median=value_median, value_limit=value_limit)
        state["row_odds"] = row
        state["row_median"] = median
        return thresholds

    def remember(self, value: float, share: float | None = None, row: float | None = None) -> None:
        if self.tracking:
            self.recent.append(value)
            del self.recent[:-RATIO_WINDOW]
        if self.peak > 0 and share is not None:
            self.recent_shares.append(float(share))
            del self.recent_shares[:-RATIO_WINDOW]
        if self.row_jump > 0 and row is not None and row > 0:  # zeros: no baseline
            self.recent_rows.append(float(row))
            del self.recent_rows[:-RATIO_WINDOW]

    def _ratio_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"recent": [float(v) for v in self.recent]} if self.tracking else {}
        if self.peak > 0:
            state["recent_shares"] = [float(v) for v in self.recent_shares]
        if self.row_jump > 0:
            state["recent_rows"] = [float(v) for v in self.recent_rows]
        return state

    def _load_ratio_state(self, state: dict[str, Any]) -> list[float]:
        """The saved ``recent`` (validated), or [] for a state saved without the criterion; the saved
        ``recent_shares`` and ``recent_rows`` go straight into place (absent from older states: they refill)."""
        windows = {}
        for key in ("recent", "recent_shares", "recent_rows"):
            window = state.get(key, [])
            if not isinstance(window, list) or len(window) > RATIO_WINDOW:
                raise ValueError(f"{key} must be a list of at most {RATIO_WINDOW} numbers, got {window!r}")
            windows[key] = [_float({key: v}, key) for v in window]
        self.recent_shares = windows["recent_shares"] if self.peak > 0 else []
        self.recent_rows = windows["recent_rows"] if self.row_jump > 0 else []
        return windows["recent"]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


class V1Detector(_RatioBaseline):
    """The v1 rule for one detection point (plus the ratio criterion when ``ratio > 0``)."""

    rule = "v1"
    exponent = 1

    def __init__(self, upper: Sequence[float] = DEFAULT_UPPER, sigma: Sequence[float] = DEFAULT_SIGMA,
                 min_steps: int = V1_MIN_STEPS, ratio: float = 0.0, peak: float = 0.0, row_jump: float = 0.0,
                 row_floor: float = ROW_ODDS_FLOOR, row_joint: float = ROW_JOINT_JUMP):
        self._start_baselines(ratio, peak, row_jump, row_floor, row_joint)
        self.upper = (float(upper[0]), float(upper[1]))
        self.sigma = (float(sigma[0]), float(sigma[1]))
        self.min_steps = int(min_steps)
        self.pre_val = 0.0
        self.min_val = 0.0
        self.max_val = 0.0
        self.count = 0

    def spread(self) -> float:
        floor = V1_SPREAD_FLOOR * max(abs(self.max_val), abs(self.min_val))
        return max(self.max_val - self.min_val, floor)

    def jump(self, value: float) -> float | None:
        """``(value - pre_val) / spread`` once the warm-up is over, else None."""
        if self.count < self.min_steps:
            return None
        spread = self.spread()
        return (value - self.pre_val) / spread if spread > 0 else None

    def check(self, value: float, share: float | None = None, row: float | None = None) -> Verdict:
        """Judges ``value``; ``share`` (the point's peak share, ``points.peak_share``) feeds the peak
        criterion and ``row`` (its row odds, ``points.row_odds``) the row criterion when they are on."""
        value, share, row = float(value), _measured(share), _measured(row)
        state: dict[str, float] = {"pre_val": self.pre_val, "min_val": self.min_val, "max_val": self.max_val,
                                   "count": self.count}
        if not _finite(value):
            return Verdict(SdcLevel.ABNORMAL, "non-finite", self._thresholds(SdcLevel.ABNORMAL), state)
        jump = self.jump(value)
        if jump is not None:
            state["jump"] = jump
        level, reason = SdcLevel.CLEAN, ""
        for candidate in (SdcLevel.ABNORMAL, SdcLevel.WARNING):
            if value > self.upper[candidate - 1]:
                level, reason = candidate, "upper"
            elif jump is not None and jump > self.sigma[candidate - 1]:
                level, reason = candidate, "jump"
            if level:
                break
        thresholds = self._thresholds(level or SdcLevel.WARNING)
        if level is not SdcLevel.ABNORMAL:
            bound = self.ratio_bound(self.count >= self.min_steps)
            if bound is not None:
                state["ratio_baseline"] = bound[0]
                if value > bound[1]:
                    level, reason, thresholds = SdcLevel.ABNORMAL, "ratio", self.ratio_thresholds(bound)
        if level is not SdcLevel.ABNORMAL:
            peak = self.peak_verdict(value, share, self.count >= self.min_steps, state)
            if peak is not None:
                level, reason, thresholds = SdcLevel.ABNORMAL, "peak", peak
        if level is not SdcLevel.ABNORMAL:
            rows = self.row_verdict(row, value, self.count >= self.min_steps, state)
            if rows is not None:
                level, reason, thresholds = SdcLevel.ABNORMAL, "row", rows
        if level is not SdcLevel.ABNORMAL:
            self._absorb(value, share, row)
        return Verdict(level, reason, thresholds, state)

    def _thresholds(self, level: int) -> dict[str, float]:
        return {"upper": self.upper[level - 1], "sigma": self.sigma[level - 1]}

    def _absorb(self, value: float, share: float | None = None, row: float | None = None) -> None:
        if self.count == 0:
            self.min_val = self.max_val = value
        else:
            self.min_val = min(self.min_val, value)
            self.max_val = max(self.max_val, value)
        self.pre_val = value
        self.count += 1
        self.remember(value, share, row)

    def state_dict(self) -> dict[str, Any]:
        return {"pre_val": float(self.pre_val), "min_val": float(self.min_val), "max_val": float(self.max_val),
                "count": int(self.count), **self._ratio_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = {key: _float(state, key) for key in ("pre_val", "min_val", "max_val")}
        count = _count(state, "count")
        recent = self._load_ratio_state(state)
        self.pre_val, self.min_val, self.max_val = values["pre_val"], values["min_val"], values["max_val"]
        self.count = count
        self.recent = recent if self.tracking else []


class V3Detector(_RatioBaseline):
    """The v3 rule for one detection point (plus the ratio criterion when ``ratio > 0``)."""

    rule = "v3"
    exponent = 2  # max(g²) grows as the square of the gradient

    def __init__(self, a1: float = V3_A1, a2: float = V3_A2, beta: float = V3_BETA, min_steps: int = V3_MIN_STEPS,
                 ratio: float = 0.0, peak: float = 0.0, row_jump: float = 0.0, row_floor: float = ROW_ODDS_FLOOR):
        if not 0 < a2 < a1:
            raise ValueError(f"v3 needs 0 < a2 < a1, got a1={a1!r}, a2={a2!r}")
        self._start_baselines(ratio, peak, row_jump, row_floor, row_joint=0.0)  # the joint test is v1's
        self.a1 = float(a1)
        self.a2 = float(a2)
        self.beta = float(beta)
        self.min_steps = int(min_steps)
        self.avg = 0.0
        self.n = 0
        self.pre_val = 0.0
        self.suspect_total = 0

    def thresholds(self) -> tuple[float, float] | None:
        """``(thr1, thr2)`` once ``n >= min_steps`` clean values are in and their mean is not 0, else None."""
        if self.n < self.min_steps or self.avg <= 0:
            return None
        correction = 1.0 - self.beta ** self.n
        return self.avg * self.a1 / correction, self.avg * self.a2 / correction

    def check(self, value: float, share: float | None = None, row: float | None = None) -> Verdict:
        """Judges ``value``; ``share`` feeds the peak criterion and ``row`` the row criterion when they are on."""
        value, share, row = float(value), _measured(share), _measured(row)
        state: dict[str, float] = {"avg": self.avg, "n": self.n, "pre_val": self.pre_val}
        bounds = self.thresholds()
        thresholds = {"thr1": bounds[0], "thr2": bounds[1]} if bounds else {}
        thresholds.update(a1=self.a1, a2=self.a2)
        if not _finite(value):
            return Verdict(SdcLevel.ABNORMAL, "non-finite", thresholds, state)
        if bounds is not None:
            thr1 = bounds[0]
            if value > thr1 and abs(value - self.pre_val) > thr1:
                return Verdict(SdcLevel.ABNORMAL, "markov", thresholds, state)
        bound = self.ratio_bound(self.n >= self.min_steps)
        if bound is not None:
            state["ratio_baseline"] = bound[0]
            if value > bound[1]:
                return Verdict(SdcLevel.ABNORMAL, "ratio", {**thresholds, **self.ratio_thresholds(bound)}, state)
        peak = self.peak_verdict(value, share, self.n >= self.min_steps, state)
        if peak is not None:
            return Verdict(SdcLevel.ABNORMAL, "peak", {**thresholds, **peak}, state)
        rows = self.row_verdict(row, value, self.n >= self.min_steps, state)
        if rows is not None:
            return Verdict(SdcLevel.ABNORMAL, "row", {**thresholds, **rows}, state)
        if bounds is not None and value > bounds[1]:
            self.pre_val = value
            self.suspect_total += 1
            self.remember(value, share, row)
            return Verdict(SdcLevel.CLEAN, "suspect", thresholds, state)
        self.avg = self.beta * self.avg + (1.0 - self.beta) * value
        self.n += 1
        self.pre_val = value
        self.remember(value, share, row)
        return Verdict(SdcLevel.CLEAN, "", thresholds, state)

    def state_dict(self) -> dict[str, Any]:
        return {"avg": float(self.avg), "n": int(self.n), "pre_val": float(self.pre_val),
                "suspect_total": int(self.suspect_total), **self._ratio_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        avg, pre_val = _float(state, "avg"), _float(state, "pre_val")
        n, suspect_total = _count(state, "n"), _count(state, "suspect_total")
        recent = self._load_ratio_state(state)
        self.avg, self.n, self.pre_val, self.suspect_total = avg, n, pre_val, suspect_total
        self.recent = recent if self.tracking else []


PointDetector = V1Detector | V3Detector


def _float(state: dict[str, Any], key: str) -> float:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _count(state: dict[str, Any], key: str) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Detection:
    """A level-1 (abnormal) or level-2 (warning) verdict on one point's value at one step, on this rank."""

    point: str
    level: SdcLevel
    value: float
    thresholds: dict[str, float]
    rule: str
    reason: str = ""
    state: dict[str, float] = field(default_factory=dict)

    @property
    def log_level(self) -> int:
        """``logging.ERROR`` for level 1, ``logging.WARNING`` for level 2."""
        return LOG_LEVELS[self.level]


class SdcDetector:
    """One rule, one detector per detection point (created on a point's first value), keyed by name."""

    def __init__(self, rule: str = "v1", names: Sequence[str] = (), *, upper: Sequence[float] = DEFAULT_UPPER,
                 sigma: Sequence[float] = DEFAULT_SIGMA, a1: float = V3_A1, a2: float = V3_A2, ratio: float = 0.0,
                 peak: float = 0.0, row_jump: float = 0.0, row_floor: float = ROW_ODDS_FLOOR,
                 row_joint: float = ROW_JOINT_JUMP):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.ratio = _check_factor("ratio", ratio)
        self.peak = _check_peak(peak)
        self.row_jump = _check_factor("row_jump", row_jump)
        self.row_floor = _check_row_floor(row_floor)
        self.row_joint = _check_factor("row_joint", row_joint)  # v1's points take it; v3's have no joint test
        self.rule = rule
        self.names = list(names)
        self.upper = tuple(upper)
        self.sigma = tuple(sigma)
        self.a1 = a1
        self.a2 = a2
        self.points: dict[str, PointDetector] = {}
        # what each point's history was measured on (``detect(layouts=...)``): a point whose layout
        # changes starts a fresh warm-up instead of judging the new values against the old ones
        self.layouts: dict[str, str] = {}
        self.detections_total = 0

    @classmethod
    def from_config(cls, config: SdcConfig, names: Sequence[str] = ()) -> SdcDetector:
        return cls(config.rule, names, upper=config.upper, sigma=config.sigma, ratio=config.ratio, peak=config.peak,
                   row_jump=config.row_jump)

    @property
    def statistic(self) -> str:
        return STATISTIC[self.rule]

    def point(self, name: str) -> PointDetector:
        detector = self.points.get(name)
        if detector is None:
            detector = self._new_point()
            self.points[name] = detector
        return detector

    def _new_point(self) -> PointDetector:
        if self.rule == "v1":
            return V1Detector(self.upper, self.sigma, ratio=self.ratio, peak=self.peak, row_jump=self.row_jump,
                              row_floor=self.row_floor, row_joint=self.row_joint)
        return V3Detector(self.a1, self.a2, ratio=self.ratio, peak=self.peak, row_jump=self.row_jump,
                          row_floor=self.row_floor)

    def restart_changed(self, names: Sequence[str], layouts: Sequence[str]) -> list[str]:
        """Records what each point measures (``layouts[i]`` for ``names[i]``: e.g. its shard's shape and
        place in the mesh) and drops the history of every point whose layout is not the one its history
        was taken on (a resume on another number of ranks, a state saved without layouts): those points
        start a fresh warm-up. Returns their names."""
        if len(layouts) != len(names):
            raise ValueError(f"{len(layouts)} layouts for {len(names)} detection points")
        restarted = []
        for name, layout in zip(names, layouts):
            if self.layouts.get(name) == layout:
                continue
            if name in self.points:
                del self.points[name]
                restarted.append(name)
            self.layouts[name] = layout
        return restarted

    def detect(self, values: Sequence[float], step: int, names: Sequence[str] | None = None,
               shares: Sequence[float] | None = None, rows: Sequence[float] | None = None) -> list[Detection]:
        """Judges one step's values (``values[i]`` belongs to ``names[i]``, by default the names given at
        construction, e.g. ``DetectionPoints.names``) and updates each point's state. A negative value
        (``NOT_CHECKED``) is skipped. Returns the level-1 and level-2 detections, in point order.
        ``step`` is accepted for symmetry with the trainer's calls; the rules do not depend on it.
        ``shares[i]``: point i's peak share (``DetectionPoints(shares=True)``), for the peak criterion;
        ``rows[i]``: its row odds (``GradientPoints(rows=True)``; negative for a point without), for the
        row criterion."""
        names = self.names if names is None else list(names)
        if len(values) != len(names) or any(extra is not None and len(extra) != len(names) for extra in (shares, rows)):
            raise ValueError(f"{len(values)} values for {len(names)} detection points")
        detections = []
        for i, (name, value) in enumerate(zip(names, values)):
            value = float(value)
            if value < 0:  # NOT_CHECKED (NaN compares False and is checked)
                continue
            row = None if rows is None else float(rows[i])  # NOT_CHECKED, NaN: the row criterion skips them
            verdict = self.point(name).check(value, None if shares is None else float(shares[i]), row)
            if verdict.level:
                detections.append(Detection(name, verdict.level, value, verdict.thresholds, self.rule,
                                            verdict.reason, verdict.state))
        self.detections_total += len(detections)
        return detections

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats, strings and dicts: loads with ``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "rule": self.rule,
            "detections_total": int(self.detections_total),
            "points": {name: detector.state_dict() for name, detector in self.points.items()},
            "layouts": dict(self.layouts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores every point's state. A state saved under the other rule is ignored (the points
        start afresh, with a warning): the rule was changed on purpose and the old state means nothing
        to the new one."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported version {state.get('version')!r}")
            rule = state["rule"]
            if rule not in RULES:
                raise ValueError(f"unknown rule {rule!r}")
            total = _count(state, "detections_total")
            points = state["points"]
            if not isinstance(points, dict):
                raise TypeError("points must be a mapping of point names to states")
            layouts = state.get("layouts", {})  # absent from states saved before layouts were kept
            if not isinstance(layouts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in layouts.items()):
                raise TypeError("layouts must be a mapping of point names to strings")
            restored: dict[str, PointDetector] = {}
            if rule == self.rule:
                for name, point_state in points.items():
                    if not isinstance(name, str) or not isinstance(point_state, dict):
                        raise TypeError(f"bad entry for point {name!r}")
                    detector = self._new_point()
                    detector.load_state_dict(point_state)
                    restored[name] = detector
        except KeyError as exc:
            raise CheckpointError(f"sdc detector state is malformed: missing key {exc}") from None
        except (AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"sdc detector state is malformed: {exc}") from None
        if rule != self.rule:
            logging.getLogger(__name__).warning(
                "sdc detector state was saved with rule %s, the run now uses %s: detection points start afresh",
                rule, self.rule)
        self.points = restored
        self.layouts = dict(layouts) if rule == self.rule else {}
        self.detections_total = total


def severity(detections: Sequence[Detection]) -> Severity:
    """The verdict of one rank's detections (all-reduced with MAX by the trainer)."""
    levels = {d.level for d in detections}
    if SdcLevel.ABNORMAL in levels:
        return Severity.ABNORMAL
    return Severity.WARNINGS if SdcLevel.WARNING in levels else Severity.NOTHING


# --------------------------------------------------------------------------------------- log lines
def _number(value: float) -> str:
    value = float(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6e}"


def format_detection(detection: Detection, step: int, rank: int, host: str, device: Any) -> str:
    """The log line of a detection: for level 1 (log it at ERROR) it holds the reference's keyword
    ``accuracy sensitivity feature abnormal``; for level 2 (WARNING) ``accuracy sensitivity feature
    warning``. ``device`` is the local device (``"cuda:3"``, ``3``, a ``torch.device``)."""
    head = ABNORMAL if detection.level == SdcLevel.ABNORMAL else WARNING_TEXT
    thresholds = ", ".join(f"{key}={_number(value)}" for key, value in detection.thresholds.items())
    state = ", ".join(f"{key}={value}" if isinstance(value, int) else f"{key}={float(value):.6e}"
                      for key, value in detection.state.items())
    reason = f" ({detection.reason})" if detection.reason else ""
    return (
        f"{head}: step {step}, rank {rank}, host {host}, local device {device}, "
        f"detection point {detection.point}, value {detection.value:.6e}, "
        f"rule {detection.rule} level {detection.level}{reason}, thresholds: {thresholds}"
        + (f", state: {state}" if state else "")
    )


def format_values(step: int, rank: int, host: str, device: Any, names: Sequence[str], values: Sequence[float]) -> str:
    """The INFO line of enabled_level 3: every point's value at this step (not-checked points left out)."""
    checked = ", ".join(f"{name}={float(value):.6e}" for name, value in zip(names, values) if not float(value) < 0)
    return f"accuracy sensitivity feature values: step {step}, rank {rank}, host {host}, local device {device}: {checked}"
