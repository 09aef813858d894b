"""Numeric guards applied between backward and the optimizer step.

- ``skip``: data skipping on global-norm spikes (absolute threshold or adaptive z-score), with a
  consecutive-spike abort;
- ``rollback``: the alternative to skipping (``check_for_global_norm``): the same spike rule decides a
  rollback to an earlier checkpoint with a window of batches skipped, widened when the spike recurs;
- ``health``: checkpoint health from the embedding local norm, recorded in ``health_ckpts.json``;
- ``calibrate``: thresholds recommended from a clean run's step events;
- ``step_verdict``: the typed verdict a step's guard answers (``StepVerdict``) and the precedence that
  turns them into the step's one decision (``decide``), here below both step engines so the closure mode's
  skeleton and live mode can share them.

All decisions are pure functions of values the trainer has already all-reduced, so every rank takes
the same one.
"""

from trainguard.guards.calibrate import Calibration, calibrate, calibrate_run
from trainguard.guards.health import (
    NO_HEALTHY_CHECKPOINT_MESSAGE,
    HealthConfig,
    is_unhealthy,
    latest_healthy_step,
    read_health_records,
    record_health,
    save_health,
    unhealthy_names,
)
from trainguard.guards.rollback import RollbackAbort, RollbackConfig, RollbackGuard, RollbackPlan, Spike
from trainguard.guards.skip import (
    ADAPTIVE_STD_FLOOR,
    DataSkipAbort,
    DataSkipGuard,
    SkipConfig,
    SkipDecision,
    SpikeRule,
)

__all__ = [
    "ADAPTIVE_STD_FLOOR",
    "Calibration",
    "DataSkipAbort",
    "DataSkipGuard",
    "HealthConfig",
    "NO_HEALTHY_CHECKPOINT_MESSAGE",
    "RollbackAbort",
    "RollbackConfig",
    "RollbackGuard",
    "RollbackPlan",
    "Spike",
    "SkipConfig",
    "SkipDecision",
    "SpikeRule",
    "calibrate",
    "calibrate_run",
    "is_unhealthy",
    "latest_healthy_step",
    "read_health_records",
    "record_health",
    "save_health",
    "unhealthy_names",
]
