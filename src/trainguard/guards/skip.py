"""Data skipping on global-norm spikes: the MindSpore Transformers rule, plus an adaptive z-score mode.

Pure logic: the trainer passes in the already all-reduced global norm, so every rank holds the same
guard state and takes the same decision at the same step. Nothing here talks to other processes.

Absolute mode (the reference's rule)
    A step whose global norm is greater than ``threshold`` is a spike: its update is skipped and the
    consecutive count goes up by one. A normal step resets the count to 0. When the count reaches
    ``count_threshold`` the run is aborted (that step is skipped too).

Adaptive mode (OLMo-style, with robust statistics)
    The guard keeps the last ``window`` finite norms. Once it holds at least ``warmup`` of them (and
    at least one), a step is a spike when ``norm > median + z_threshold * s`` with
    ``s = max(MAD_TO_STD * MAD, ADAPTIVE_STD_FLOOR * |median|)`` (``MAD``: the median absolute
    deviation of the window; ``MAD_TO_STD`` makes it estimate a standard deviation). The floor keeps
    an almost flat window from turning ordinary jitter into spikes. The absolute ``threshold`` is
    ignored in this mode. A skipped finite norm enters the window too, **clipped to the threshold it
    was judged against**: the guard keeps learning while it skips, a streak of huge spikes cannot
    drag the bar up beyond the bar itself, and the median/MAD do not move for a few outliers.

    Regime change: when ``regime_steps`` (default 5, fewer than ``count_threshold``) consecutive
    finite spikes lie within a factor ``REGIME_BAND`` of each other, the norm has moved to a new
    level (a sequence-length change, a new data mix), not spiked: the window restarts from those
    values, the step is not skipped and the count goes back to 0 (a ``regime change`` line is logged).
    A diverging run, whose norms keep growing, does not qualify and still aborts.

    ``loss: true`` adds a loss-spike test beside the norm's (adaptive, its own window): a step whose
    loss is an outlier is skipped too (``decide(..., loss=...)``).
In both modes a NaN or infinite norm is always a spike (counted, skipped, and counted in ``nan_total``).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainguard.errors import EXIT_DATA_SKIP_ABORT, CheckpointError, ConfigError, TrainguardError

MODES = ("absolute", "adaptive")

# Adaptive mode: the spread used in the z-score is at least this fraction of the window's median.
# With z_threshold = 6 a step must then exceed 1.3 x the median before it can be skipped.
ADAPTIVE_STD_FLOOR = 0.05
MAD_TO_STD = 1.4826  # the MAD of a normal distribution times this is its standard deviation
# consecutive spikes within this factor of each other (max <= REGIME_BAND x min) are a new regime
REGIME_BAND = 3.0

_STATE_VERSION = 1


@dataclass
class SkipConfig:
    enabled: bool = False
    threshold: float = 3.0  # global_norm_spike_threshold
    count_threshold: int = 10  # global_norm_spike_count_threshold
    mode: str = "absolute"  # "absolute" | "adaptive"
    window: int = 128  # adaptive: last W non-skipped steps
    z_threshold: float = 6.0  # adaptive: skip when the z-score is greater than this
    warmup: int = 20  # adaptive: no adaptive skip until this many norms are in the window
    # adaptive: this many consecutive spikes at one level (within REGIME_BAND) restart the window; 0 = off
    regime_steps: int = 5
    loss: bool = False  # adaptive loss-spike test beside the norm's: a loss outlier is skipped too
    # steps skipped whatever their norm: a fault-free reference replaying another run's skip decisions
    replay_steps: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad key (trainguard names, reference names in brackets)."""

        def positive(key: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
            ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
            bad = isinstance(value, bool) or not ok_type or not math.isfinite(value)
            if bad or value < 0 or (value == 0 and not allow_zero):
                kind = ("non-negative " if allow_zero else "positive ") + ("integer" if integer else "number")
                raise ConfigError(f"config key {key} must be a {kind}, got {value!r}")

        positive("guards.skip.threshold (global_norm_spike_threshold)", self.threshold)
        positive("guards.skip.count_threshold (global_norm_spike_count_threshold)", self.count_threshold, integer=True)
        if self.mode not in MODES:
            raise ConfigError(f"config key guards.skip.mode must be 'absolute' or 'adaptive', got {self.mode!r}")
        positive("guards.skip.window", self.window, integer=True)
        positive("guards.skip.z_threshold", self.z_threshold)
        positive("guards.skip.warmup", self.warmup, integer=True, allow_zero=True)
        positive("guards.skip.regime_steps", self.regime_steps, integer=True, allow_zero=True)
        if not isinstance(self.loss, bool):
            raise ConfigError(f"config key guards.skip.loss must be true or false, got {self.loss!r}")
        for step in self.replay_steps:
            positive("guards.skip.replay_steps", step, integer=True)


@dataclass(frozen=True)
class SkipDecision:
    skip: bool  # do not apply this step's update
    nan: bool  # the norm was NaN or infinite
    abort: bool  # stop training (raise DataSkipAbort(reference_abort_message(decision)))
    consecutive: int  # consecutive spikes including this step
    threshold: float  # the threshold applied (adaptive: median + Z * s; inf while warming up)
    step: int  # the trainer's step, as the reference's lines name it
    global_norm: float
    opt_global_step: int  # the optimizer's count of applied updates
    enabled: bool  # the guard is on: the reference's lines are due
    loss_spike: bool = False  # the loss test (``loss: true``) found a spike
    loss: float | None = None
    loss_threshold: float = math.inf
    regime_change: bool = False  # a streak at one level restarted the adaptive window; not skipped


class DataSkipAbort(TrainguardError):
    """Too many consecutive global-norm spikes; the message is the reference's (exit 3)."""

    exit_code = EXIT_DATA_SKIP_ABORT


def format_norm(value: float) -> str:
    """A norm as the reference prints a one-element array: ``[44.313248]``."""
    return f"[{value:.6f}]"


def format_is_skip(skip: bool) -> str:
    """A bool as numpy prints a one-element bool array: ``[ True]`` / ``[False]``."""
    return "[ True]" if skip else "[False]"


def is_skip_line(opt_global_step: int, threshold: float, skip: bool) -> str:
    return (
        f"opt_global_step: {opt_global_step}, skip_data_grad_norm_threshold: {float(threshold)!r}, "
        f"is_skip: {format_is_skip(skip)}"
    )


def spike_line(step: int, global_norm: float, consecutive: int, threshold: float) -> str:
    return (
        f"Current global norm {format_norm(global_norm)} of step {step} has been {consecutive} "
        f"consecutive times greater than threshold: {float(threshold)!r}"
    )


def loss_spike_line(step: int, loss: float, threshold: float) -> str:
    return f"Current loss {format_norm(loss)} of step {step} is greater than threshold: {float(threshold)!r}"


def regime_line(step: int, global_norm: float) -> str:
    return (f"Current global norm {format_norm(global_norm)} of step {step}: consecutive spikes at one level, "
            f"a regime change; the adaptive window restarts from them and the step is not skipped")


def abort_text(step: int, global_norm: float, consecutive: int, threshold: float) -> str:
    # No colon after "threshold": the reference's abort message differs from its INFO line.
    return (
        f"Current global norm {format_norm(global_norm)} of step {step} has been {consecutive} "
        f"consecutive times greater than threshold {float(threshold)!r}, stop training..."
    )


def reference_log_lines(decision: SkipDecision) -> tuple[str, ...]:
    """What the reference logs at INFO for a decision, in its words (the log boundary's business)."""
    if not decision.enabled:
        return ()
    lines = [is_skip_line(decision.opt_global_step, decision.threshold, decision.skip)]
    if decision.regime_change:
        lines.append(regime_line(decision.step, decision.global_norm))
    elif decision.loss_spike:
        lines.append(loss_spike_line(decision.step, float(decision.loss), decision.loss_threshold))
    if decision.skip and not decision.abort:
        lines.append(spike_line(decision.step, decision.global_norm, decision.consecutive, decision.threshold))
    return tuple(lines)


def reference_abort_message(decision: SkipDecision) -> str | None:
    """The reference's ValueError text for an abort, without "ValueError: "; None for any other decision."""
    if not decision.abort:
        return None
    return abort_text(decision.step, decision.global_norm, decision.consecutive, decision.threshold)


class SpikeRule:
    """The spike test of the module docstring (absolute or adaptive), shared by data skip and rollback.

    ``is_spike`` compares a value with the current threshold; ``accept`` adds a value judged normal to
    the window the adaptive statistics come from. ``mode`` overrides the configured mode (rollback's
    loss test is always adaptive: an absolute loss threshold would mean nothing).
    """

    def __init__(self, cfg: SkipConfig, mode: str | None = None):
        self.cfg = cfg
        self.mode = mode or cfg.mode
        self._window: deque[float] = deque(maxlen=cfg.window)

    @property
    def window(self) -> tuple[float, ...]:
        return tuple(self._window)

    def threshold(self) -> float:
        """The threshold the next value is compared against (``inf`` while adaptive mode warms up)."""
        if self.mode == "absolute":
            return float(self.cfg.threshold)
        if len(self._window) < max(self.cfg.warmup, 1):
            return math.inf
        values = list(self._window)
        middle = statistics.median(values)
        spread = MAD_TO_STD * statistics.median(abs(v - middle) for v in values)
        return middle + self.cfg.z_threshold * max(spread, ADAPTIVE_STD_FLOOR * abs(middle))

    def is_spike(self, value: float) -> tuple[bool, bool, float]:
        """(spike, non-finite, threshold applied); a NaN or infinite value is always a spike."""
        nan = not math.isfinite(value)
        threshold = self.threshold()
        return nan or value > threshold, nan, threshold

    def accept(self, value: float) -> None:
        self._window.append(float(value))

    def restart(self, values: list[float]) -> None:
        """A new regime: the window holds only ``values`` (it warms up again from them)."""
        self._window = deque((float(v) for v in values), maxlen=self.cfg.window)

    def window_state(self) -> list[float]:
        return [float(v) for v in self._window]

    def load_window(self, values: list[float], what: str) -> None:
        window = [float(v) for v in values]
        if not all(math.isfinite(v) for v in window):
            raise CheckpointError(f"{what} state is malformed: window holds a non-finite value")
        self._window = deque(window, maxlen=self.cfg.window)


class DataSkipGuard:
    """Decides, once per optimizer step, whether to skip the step's update or abort the run."""

    def __init__(self, cfg: SkipConfig, tokens_per_step: int | None = None):
        cfg.validate()
        self.cfg = cfg
        # what the norms are measured on: a state saved at another number of tokens per step (a
        # sequence-length switch, another global batch) describes other norms, and its windows are dropped
        self.tokens_per_step = tokens_per_step
        self.skipped_total = 0
        self.nan_total = 0
        self.consecutive = 0
        # Recent finite norms (skipped ones clipped), kept in both modes so the mode can change on resume.
        self.rule = SpikeRule(cfg)
        self.loss_rule = SpikeRule(cfg, mode="adaptive") if cfg.loss else None
        self.streak: list[tuple[float, float | None]] = []  # the current streak's finite (norm, loss)

    @property
    def window(self) -> tuple[float, ...]:
        """The norms the adaptive statistics are computed from, oldest first."""
        return self.rule.window

    def current_threshold(self) -> float:
        """The threshold the next step is compared against (``inf`` while adaptive mode warms up)."""
        return self.rule.threshold()

    @property
    def _regimes(self) -> bool:
        return self.cfg.mode == "adaptive" and 0 < self.cfg.regime_steps < self.cfg.count_threshold

    def _new_regime(self, streak: list[tuple[float, float | None]]) -> bool:
        if not streak or len(streak) < self.cfg.regime_steps:
            return False
        series = [[norm for norm, _ in streak]]
        if self.loss_rule is not None:
            series.append([loss for _, loss in streak])
        return all(min(values) > 0 and max(values) <= REGIME_BAND * min(values) for values in series)

    def decide(self, step: int, global_norm: float, opt_global_step: int, loss: float | None = None) -> SkipDecision:
        """``step``: the trainer's step number for the messages; ``opt_global_step``: the optimizer's
        count of applied updates (it stays put while steps are skipped); ``loss``: the step's loss,
        for the loss-spike test (``loss: true``)."""
        norm = float(global_norm)
        spike, nan, threshold = self.rule.is_spike(norm)
        loss_spike, loss_threshold = False, math.inf
        if self.loss_rule is not None and loss is not None:
            loss = float(loss)
            loss_spike, loss_nan, loss_threshold = self.loss_rule.is_spike(loss)
            nan = nan or loss_nan
        replayed = step in self.cfg.replay_steps
        if not self.cfg.enabled:
            return SkipDecision(False, nan, False, 0, threshold, step, norm, opt_global_step, enabled=False)
        spike = spike or loss_spike or replayed
        streak = [*self.streak, (norm, loss)] if spike and not nan and not replayed and self._regimes else []
        regime = spike and self._new_regime(streak)
        if regime:
            spike, streak = False, []
            self.rule.restart([n for n, _ in self.streak] + [norm])
            if self.loss_rule is not None:
                self.loss_rule.restart([v for _, v in self.streak if v is not None] + ([loss] if loss is not None else []))
        self.streak = streak
        if spike:
            self.consecutive += 1
            self.skipped_total += 1
            self.nan_total += nan
        else:
            self.consecutive = 0
        if not regime:
            # learning goes on while skipping: a finite value enters, clipped to the bar it was judged against
            if math.isfinite(norm):
                self.rule.accept(min(norm, threshold))
            if self.loss_rule is not None and loss is not None and math.isfinite(loss):
                self.loss_rule.accept(min(loss, loss_threshold))
        return SkipDecision(
            skip=spike,
            nan=nan,
            abort=spike and self.consecutive >= self.cfg.count_threshold,
            consecutive=self.consecutive,
            threshold=threshold,
            step=step,
            global_norm=norm,
            opt_global_step=opt_global_step,
            enabled=True,
            loss_spike=loss_spike and spike,
            loss=loss,
            loss_threshold=loss_threshold,
            regime_change=regime,
        )

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats and lists: loads with ``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "skipped_total": int(self.skipped_total),
            "nan_total": int(self.nan_total),
            "consecutive": int(self.consecutive),
            "window": self.rule.window_state(),
            "streak": [[n, v] for n, v in self.streak],
            "loss_window": self.loss_rule.window_state() if self.loss_rule is not None else [],
            "tokens_per_step": self.tokens_per_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores counts and window; a resume in the middle of a streak continues it. A window longer
        than the configured one keeps its newest values."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported version {state.get('version')!r}")
            counts = {key: state[key] for key in ("skipped_total", "nan_total", "consecutive")}
            for key, value in counts.items():
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
            window = [float(v) for v in state["window"]]
            if not all(math.isfinite(v) for v in window):
                raise ValueError("window holds a non-finite norm")
            # absent from states saved before the regime and loss tests existed
            streak = [(float(n), None if v is None else float(v)) for n, v in state.get("streak", [])]
            loss_window = [float(v) for v in state.get("loss_window", [])]
            saved_tokens = state.get("tokens_per_step")  # absent from states saved before it was kept
            if saved_tokens is not None and (isinstance(saved_tokens, bool) or not isinstance(saved_tokens, int)):
                raise ValueError(f"tokens_per_step must be an integer, got {saved_tokens!r}")
        except KeyError as exc:
            raise CheckpointError(f"data skip guard state is malformed: missing key {exc}") from None
        except (AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"data skip guard state is malformed: {exc}") from None
        self.skipped_total = counts["skipped_total"]
        self.nan_total = counts["nan_total"]
        self.consecutive = counts["consecutive"]
        if self.tokens_per_step is not None and saved_tokens not in (None, self.tokens_per_step):
            # a norm over other tokens per step is on another scale (issue 39: after a switch from 128 to 16
            # tokens a sequence, 14 of the next 20 steps were skipped): the adaptive windows warm up again
            logging.getLogger(__name__).info(
                "data skip: the state was saved at %d tokens per step, the run now has %d: the adaptive windows "
                "start a fresh warm-up", saved_tokens, self.tokens_per_step)
            window, loss_window, streak = [], [], []
        self.rule.load_window(window, "data skip guard")
        self.streak = streak
        if self.loss_rule is not None:
            self.loss_rule.load_window(loss_window, "data skip guard")
