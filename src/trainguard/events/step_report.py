"""What a step says (rank 0 in the closure mode, the quorum's first member in live mode): the reference's log
line and the ``step`` event's fields; both step engines write it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepReport:
    step: int
    total: int | None  # the schedule's last step, when the loop told the guard (should_stop)
    loss: float
    global_norm: float
    lr: float
    seconds: float
    skipped: bool
    tokens_per_step: int | None = None  # global tokens one step trains on, when the loop told the guard
    skip_totals: dict[str, int] | None = None  # skipped_total, nan_total (data skip on)
    embedding_local_norm: float | None = None  # rank 0's (guards.monitor or health on)
    sample_ranges: list[tuple[int, int]] | None = None  # global positions trained on (rollback mode)

    @property
    def tokens_per_s(self) -> float | None:
        if self.tokens_per_step is None:
            return None
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0

    def log_lines(self) -> list[str]:
        total = self.total if self.total is not None else self.step
        line = (f"step: [{self.step:5d}/{total:5d}], loss: {self.loss:.3f}, "
                f"global_norm: [{self.global_norm:.3f}], lr: {self.lr:.1e}, "
                f"per_step_time: {round(self.seconds * 1000)}ms")
        if self.tokens_per_s is not None:
            line += f", tokens/s: {round(self.tokens_per_s)}"
        if self.skip_totals is not None:
            line += (f", number of skipped iterations: {self.skip_totals['skipped_total']}, "
                     f"number of nan iterations: {self.skip_totals['nan_total']}")
        lines = [line]
        if self.embedding_local_norm is not None:
            lines.append(f"embedding_local_norm: {self.embedding_local_norm:.5f}")
        return lines

    def event_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"step": self.step, "loss": self.loss, "global_norm": self.global_norm,
                                  "lr": self.lr, "step_time": self.seconds}
        if self.tokens_per_s is not None:
            fields["tokens_per_s"] = self.tokens_per_s
        fields["skipped"] = self.skipped
        fields.update(self.skip_totals or {})
        if self.embedding_local_norm is not None:
            fields["embedding_local_norm"] = self.embedding_local_norm
        if self.sample_ranges is not None:
            fields["sample_ranges"] = [list(r) for r in self.sample_ranges]
        return fields

    def log_to(self, log: logging.Logger, log_interval: int) -> None:
        """The step's lines, when due (``train.log_interval``)."""
        if self.due(log_interval):
            for line in self.log_lines():
                log.info(line)

    def due(self, log_interval: int) -> bool:
        """Whether the log line is written for this step (every ``log_interval`` steps and the last)."""
        return self.step % log_interval == 0 or self.step == self.total
