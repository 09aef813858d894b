"""The save interval that minimises expected lost time (Young/Daly), and the goodput it gives (pure)."""

from __future__ import annotations

import math


def optimal_save_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum √(2·C·MTBF): seconds of training between checkpoints."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("save time and MTBF must be positive")
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def expected_goodput(interval_seconds: float, save_seconds: float, mtbf_seconds: float,
                     restart_seconds: float = 0.0) -> float:
    """Fraction of wall time that is kept progress: the save's own cost C/τ, plus per failure half an
    interval of lost work and the restart, (τ/2 + R)/MTBF (first order, valid for τ ≪ MTBF)."""
    if interval_seconds <= 0:
        raise ValueError("interval must be positive")
    lost = save_seconds / interval_seconds + (interval_seconds / 2 + restart_seconds) / mtbf_seconds
    return max(0.0, 1.0 - lost)
