"""Rollback mode (``check_for_global_norm``): on a spike, go back to a checkpoint and skip the data around it.

PaLM's published practice, and MindSpore's fault-recovery alternative to data skipping: when the
global norm (or, optionally, the loss) spikes at step S, the run restores the newest healthy checkpoint
from before S (step C), skips the batches of steps ``S - window_before .. S + window_after`` (those at
or before C are already trained into the checkpoint, so the window starts at C + 1 at the earliest) and
continues. Pure logic: the trainer passes in the already all-reduced norm and loss, so every rank
holds the same state and reaches the same verdict at the same step.

Spike test
    The very rule data skip uses (``guards.skip``: absolute ``threshold`` or the adaptive z-score over
    the last ``window`` normal steps; NaN/Inf always a spike), through the same ``SpikeRule``. The loss
    test (``guards.rollback.loss``) always uses the adaptive form of that rule.

Recurrence, widening, stop
    A rollback for a spike at S with ``after`` steps skipped after it leaves the run "without progress"
    until it has trained past step ``S + after``. A spike at a step up to that one is the same spike
    recurring: the window is multiplied by ``widen_factor`` (before and after, rounded up) and the count
    of rollbacks without progress goes up; a spike later than that is a new one and starts again from
    the configured window. A spike arriving when ``max_rollbacks`` rollbacks have already been made
    without progress stops the run (exit 3) with a summary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.errors import CheckpointError, ConfigError
from trainguard.guards.skip import DataSkipAbort, SkipConfig, SpikeRule, format_norm

_STATE_VERSION = 1


@dataclass
class RollbackConfig:
    window_before: int = 100  # steps before the spike whose batches are skipped
    window_after: int = 100  # steps after the spike (the spike's own step is always skipped)
    widen_factor: float = 2.0  # a recurring spike multiplies both sides of the window by this
    max_rollbacks: int = 3  # rollbacks without progress before the run stops (exit 3)
    loss: bool = False  # also roll back on loss spikes (adaptive rule of guards.skip)

    def validate(self, source: str = "<config>") -> None:
        def integer(key: str, value: Any, minimum: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{source}: config key 'guards.rollback.{key}' must be an integer ≥ {minimum}, "
                                  f"got {value!r}")

        integer("window_before", self.window_before, 0)
        integer("window_after", self.window_after, 0)
        integer("max_rollbacks", self.max_rollbacks, 1)
        factor = self.widen_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
            raise ConfigError(f"{source}: config key 'guards.rollback.widen_factor' must be a number ≥ 1, "
                              f"got {factor!r}")


@dataclass(frozen=True)
class Spike:
    step: int
    metric: str  # "global_norm" or "loss"
    value: float
    threshold: float


@dataclass(frozen=True)
class RollbackPlan:
    """What to skip for a spike: the batches of steps ``first_step..last_step`` (the numbering of the
    timeline being abandoned); ``first_step`` is moved past the restored checkpoint by the trainer."""

    spike: Spike
    first_step: int
    last_step: int
    attempt: int  # rollbacks without progress for this spike, this one included


class RollbackAbort(DataSkipAbort):
    """A spike recurred after ``max_rollbacks`` rollbacks without progress, or nothing to roll back to (exit 3)."""


@dataclass
class _History:
    attempts: int = 0  # rollbacks without progress so far
    progress_step: int = 0  # the run has made progress once it trained past this step
    windows: list[list[int]] = field(default_factory=list)  # [first_step, last_step] of each such rollback


class RollbackGuard:
    """Spike verdicts and rollback plans; its state rides in checkpoints (``state_dict``)."""

    def __init__(self, cfg: RollbackConfig, rule_cfg: SkipConfig):
        cfg.validate()
        rule_cfg.validate()
        self.cfg = cfg
        self.norm_rule = SpikeRule(rule_cfg)
        self.loss_rule = SpikeRule(rule_cfg, mode="adaptive") if cfg.loss else None
        self.history = _History()
        self.rollbacks_total = 0

    def check(self, step: int, global_norm: float, loss: float) -> Spike | None:
        """The spike at this step, if any; a normal step's values enter the adaptive windows."""
        norm, loss = float(global_norm), float(loss)
        spike, _, threshold = self.norm_rule.is_spike(norm)
        if spike:
            return Spike(step, "global_norm", norm, threshold)
        if self.loss_rule is not None:
            spike, _, threshold = self.loss_rule.is_spike(loss)
            if spike:
                return Spike(step, "loss", loss, threshold)
            self.loss_rule.accept(loss)
        self.norm_rule.accept(norm)
        return None

    def plan(self, spike: Spike) -> RollbackPlan:
        """The window to skip for ``spike``; raises RollbackAbort when the run must stop instead."""
        history = self.history
        recurring = history.attempts > 0 and spike.step <= history.progress_step
        if recurring and history.attempts >= self.cfg.max_rollbacks:
            raise RollbackAbort(self.abort_summary(spike))
        attempt = history.attempts + 1 if recurring else 1
        scale = self.cfg.widen_factor ** (attempt - 1)
        before = math.ceil(self.cfg.window_before * scale)
        after = math.ceil(self.cfg.window_after * scale)
        plan = RollbackPlan(spike, max(1, spike.step - before), spike.step + after, attempt)
        windows = history.windows if recurring else []
        self.history = _History(attempt, plan.last_step, [*windows, [plan.first_step, plan.last_step]])
        self.rollbacks_total += 1
        return plan

    def starts_after(self, restored_step: int) -> int:
        """The first step of the current window once the checkpoint of ``restored_step`` is restored:
        steps up to it are already trained into that checkpoint and cannot be skipped."""
        window = self.history.windows[-1]
        window[0] = max(window[0], restored_step + 1)
        return window[0]

    def abort_summary(self, spike: Spike, reason: str | None = None) -> str:
        windows = ", ".join(f"steps {a}-{b}" for a, b in self.history.windows) or "none"
        why = reason or (f"recurred after {self.history.attempts} rollbacks without progress "
                         f"(guards.rollback.max_rollbacks={self.cfg.max_rollbacks})")
        return (f"rollback: {spike.metric} {format_norm(spike.value)} of step {spike.step} is greater than threshold "
                f"{float(spike.threshold)!r} and {why}; skipped windows: {windows}; "
                f"rollbacks in this run: {self.rollbacks_total}, stop training...")

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain ints, floats and lists: loads with ``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "norm_window": self.norm_rule.window_state(),
            "loss_window": self.loss_rule.window_state() if self.loss_rule is not None else [],
            "attempts": int(self.history.attempts),
            "progress_step": int(self.history.progress_step),
            "windows": [[int(a), int(b)] for a, b in self.history.windows],
            "rollbacks_total": int(self.rollbacks_total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported version {state.get('version')!r}")
            counts = {key: state[key] for key in ("attempts", "progress_step", "rollbacks_total")}
            for key, value in counts.items():
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
            windows = [[int(a), int(b)] for a, b in state["windows"]]
            self.norm_rule.load_window(state["norm_window"], "rollback guard")
            if self.loss_rule is not None:
                self.loss_rule.load_window(state["loss_window"], "rollback guard")
        except KeyError as exc:
            raise CheckpointError(f"rollback guard state is malformed: missing key {exc}") from None
        except (AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"rollback guard state is malformed: {exc}") from None
        self.history = _History(counts["attempts"], counts["progress_step"], windows)
        self.rollbacks_total = counts["rollbacks_total"]

    def policy_state(self) -> tuple[_History, int]:
        """What a rollback must carry across the reload of an older checkpoint (the windows of normal
        values come from the checkpoint: they describe the model being restored)."""
        return self.history, self.rollbacks_total

    def restore_policy_state(self, state: tuple[_History, int]) -> None:
        self.history, self.rollbacks_total = state
