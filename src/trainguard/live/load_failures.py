"""A live restore's checkpoint that will not load (rollback mode's restore, replica fingerprints' recompute).

The restore is the quorum's (``LiveCheckpoints.roll_back``): a load that raises, on one member or all, raises
on every member alike (``CheckpointManager.roll_back``: ``RestoreFailed``), the epoch ends as after a failed
collective and the step, tried again, restores again: a transient read error passes on a retry. A checkpoint
whose load failed ``fault_tolerance.max_step_failures`` times is passed over from then on, as an unhealthy one
is, and the restore walks back to the next older healthy checkpoint (the newer ones are deleted only once an
older one has loaded). With none left the run ends: ``NothingToRestore`` (exit 19, as a step that failed as
often), naming the checkpoints passed over and their errors, every checkpoint left as it was.

Pure: ``LoadFailures`` counts, ``LiveCheckpoints`` asks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.checkpoint.discovery import CheckpointInfo
from trainguard.live.step_failures import StepFailed


class NothingToRestore(StepFailed):
    """Every healthy checkpoint before a restore's step was passed over: each failed to load too often."""


@dataclass
class LoadFailures:
    """The failed loads of each durable checkpoint this process's restores chose, by the checkpoint's step."""

    limit: int  # fault_tolerance.max_step_failures: the loads of one checkpoint tried before it is passed over
    counts: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # the last error of each, in one line

    def failed(self, step: int, error: str) -> bool:
        """Counts a failed load of the checkpoint of ``step``: whether it is passed over from now on."""
        self.counts[step] = self.counts.get(step, 0) + 1
        self.errors[step] = error
        return self.counts[step] == self.limit

    def passed_over(self, step: int) -> bool:
        return self.counts.get(step, 0) >= self.limit

    def rejection(self, info: CheckpointInfo) -> str | None:
        """``CheckpointManager``'s ``accept``: why the checkpoint is passed over, None when it is not."""
        if not self.passed_over(info.step):
            return None
        return f"it failed to load {self.counts[info.step]} times (fault_tolerance.max_step_failures): " \
               f"{self.errors[info.step]}"

    def before(self, before_step: int) -> list[str]:
        """The checkpoints passed over of a step before ``before_step``, newest first, each with its error."""
        return [f"global_step_{step} ({self.counts[step]} failed loads, the last: {self.errors[step]})"
                for step in sorted(self.counts, reverse=True) if step < before_step and self.passed_over(step)]
