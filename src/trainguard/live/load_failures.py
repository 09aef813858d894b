"""A live restore's checkpoint that will not load (rollback mode's restore, replica fingerprints' recompute).

The restore is the quorum's (``LiveCheckpoints.roll_back``): a load that raises, on one member or all, raises
on every member alike (``CheckpointManager.roll_back``: ``RestoreFailed``), the epoch ends as after a failed
collective and the step, tried again, restores again: a transient read error passes on a retry. A checkpoint
whose load failed ``fault_tolerance.max_step_failures`` times is passed over from then on, as an unhealthy one
is, and the restore walks back to the next older healthy checkpoint (the newer ones are deleted only once an
older one has loaded). With none left the run ends: ``NothingToRestore`` (exit 19, as a step that failed as
often), naming the checkpoints passed over and their errors, every checkpoint left as it was.

The counts are the run's, in the launcher's store, each rank's own (a replacement goes on from its
predecessor's): a member counts each failed restore it saw (a peer may leave the epoch on the first member's
end of it instead, never having seen the error), and a checkpoint's count is the highest of its ranks', read
by whichever member chooses the checkpoint, a joiner's too. Every failed restore is seen by at least the member
that ended its epoch, so a checkpoint is passed over after at most ``limit`` times the members failed restores,
``limit`` when every member saw each (DCP raises on every member alike).
"""

from __future__ import annotations

import torch.distributed as dist

from trainguard.live.step_failures import StepFailed


class NothingToRestore(StepFailed):
    """Every healthy checkpoint before a restore's step was passed over: each failed to load too often."""


def count_key(step: int, rank: int) -> str:
    return f"load_failures/{step}/{rank}"


def error_key(step: int) -> str:
    return f"load_failure_error/{step}"


class LoadFailures:
    """The failed loads of each durable checkpoint the run's restores chose, by the checkpoint's step, in
    ``store``, as ``rank`` of ``world`` counts them; one that failed ``limit`` times
    (``fault_tolerance.max_step_failures``) is passed over."""

    def __init__(self, store: dist.Store, rank: int, world: int, limit: int):
        self.store, self.rank, self.world, self.limit = store, rank, world, limit

    def failed(self, step: int, error: str) -> None:
        """A failed restore of the checkpoint of ``step``, as this rank saw it."""
        self.store.set(error_key(step), error)
        self.store.add(count_key(step, self.rank), 1)

    def count(self, step: int) -> int:
        """The highest of the ranks' counts of the checkpoint's failed loads."""
        return max(self.store.add(count_key(step, rank), 0) for rank in range(self.world))

    def rejection(self, step: int, count: int) -> str | None:
        """Why the checkpoint of ``step``, whose loads failed ``count`` times (``count``), is passed over (for
        ``CheckpointManager``'s ``accept``); None when it is not."""
        if count < self.limit:
            return None
        return f"it failed to load {count} times (fault_tolerance.max_step_failures): " \
               f"{self.store.get(error_key(step)).decode()}"

    def passed_over(self, steps: list[int]) -> list[str]:
        """Of ``steps``, the checkpoints passed over, in that order, each with its count and last error."""
        counts = {step: self.count(step) for step in steps}
        return [f"global_step_{step} ({count} failed loads, the last: {self.store.get(error_key(step)).decode()})"
                for step, count in counts.items() if count >= self.limit]
