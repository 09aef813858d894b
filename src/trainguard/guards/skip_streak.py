"""The skip streak: a run that skips every step for ``guards.max_consecutive_skips`` steps trains nothing.

Whatever skipped them (a data-skip spike, a non-finite global norm, an SDC detection that the rerun
reproduced), that many skipped steps in a row mean the run is stuck: corrupt state that every batch
trips on, thresholds that no longer fit, data gone bad. Exiting 0 after such a run reports a success
that did not happen (issue 39: a run resumed from a corrupt checkpoint skipped every remaining step
and exited 0). The streak aborts it instead, with exit 3 (``EXIT_DATA_SKIP_ABORT``), the code of the
data-skip guard's own abort. Any applied step resets the count. Pure logic; the step all-reduces its
skip decision before, so every rank counts alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.errors import CheckpointError

DEFAULT_MAX_CONSECUTIVE_SKIPS = 20


@dataclass(frozen=True)
class StreakVerdict:
    consecutive: int  # skipped steps in a row, this one included (0 after an applied step)
    abort: bool  # the streak reached the limit: stop the run with exit 3


class SkipStreak:
    """Counts skipped steps in a row; ``limit`` 0 never aborts."""

    def __init__(self, limit: int = DEFAULT_MAX_CONSECUTIVE_SKIPS):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer (0 = off), got {limit!r}")
        self.limit = limit
        self.consecutive = 0

    def note(self, skipped: bool) -> StreakVerdict:
        self.consecutive = self.consecutive + 1 if skipped else 0
        return StreakVerdict(self.consecutive, self.limit > 0 and self.consecutive >= self.limit)

    def message(self, step: int) -> str:
        return (f"step {step}: the last {self.consecutive} steps were all skipped: the run trains nothing "
                f"(guards.max_consecutive_skips {self.limit}), stop training")

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": int(self.consecutive)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consecutive = state.get("consecutive") if isinstance(state, dict) else None
        if isinstance(consecutive, bool) or not isinstance(consecutive, int) or consecutive < 0:
            raise CheckpointError(f"skip streak state is malformed: consecutive must be a non-negative integer, "
                                  f"got {consecutive!r}")
        self.consecutive = consecutive
