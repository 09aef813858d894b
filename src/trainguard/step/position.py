"""Where a closure-mode run is, shared by ``Guard`` (resume, stop, close) and its step skeleton."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RunPosition:
    exit_at_step: int | None  # train.exit_at_step
    step: int = 0  # the step the run is at: the last one applied, skipped or restored
    total: int | None = None  # the schedule's last step, once the loop told (``should_stop``)
    last_loss: float = math.nan  # the loss of the last step taken, for the manifests

    @property
    def stop_at(self) -> float:
        """The step the run stops at: ``total`` or ``exit_at_step``, the earlier (inf while unknown)."""
        total = self.total if self.total is not None else math.inf
        return min(total, self.exit_at_step) if self.exit_at_step is not None else total
