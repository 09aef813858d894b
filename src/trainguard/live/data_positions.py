"""Live mode's data positions under rollback mode (``guards.check_for_global_norm``): the position a step's
``loss_of(model, step, micro_batch)`` is handed as its ``step``.

A rollback restores an earlier checkpoint and never feeds a window of data positions again
(``checkpoint/rollback.roll_back``, the closure mode's policy, one position a step). The optimizer steps
then go on from the checkpoint's step while the data positions jump past the window: the position of
step ``t`` is the ``t``-th position (from 0) that is not skipped, a pure function of ``t`` and the skipped
ranges. The ranges ride in the guards' state (``live/step_judge.LiveJudge``): kept for an undone step,
sent to a joining rank, saved in the durable tier. Without a rollback the position is the step.
"""

from __future__ import annotations

from typing import Any

from trainguard.checkpoint.rollback import SkippedPositions
from trainguard.errors import CheckpointError


class DataPositions(SkippedPositions):
    """``SkippableData`` with one position a step; ``consumed_samples`` is moved to a restored step's
    position (``move_to``) before ``roll_back`` spans the window from it."""

    def position(self, step: int) -> int:
        """The data position of ``step`` (from 0): the ``step``-th position that is not skipped."""
        ranges, _ = self.take(0, step + 1)
        return ranges[-1][1] - 1

    def move_to(self, step: int) -> None:
        _, self.consumed_samples = self.take(0, step)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": [[int(a), int(b)] for a, b in self.skipped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        skipped = state.get("skipped") if isinstance(state, dict) else None
        if not isinstance(skipped, list) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(p, int) and not isinstance(p, bool) for p in pair) and 0 <= pair[0] < pair[1]
                for pair in skipped):
            raise CheckpointError(f"live guards' state is malformed: data_positions.skipped must be a list of "
                                  f"[start, end) position pairs, got {skipped!r}")
        self.skipped = []
        for start, end in skipped:
            self.skip(start, end)
