"""What a closure's rerun needs restored: every RNG of the process and the user's stateful objects.

Taken before the closure runs (only when SDC detection may ask for a rerun), so that a closure that
draws its batch from a stateful data loader draws the same batch again, with the same dropout masks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state


@dataclass(frozen=True)
class StepSnapshot:
    rng: dict[str, Any]
    states: dict[str, Any]

    @classmethod
    def take(cls, stateful: Mapping[str, Any]) -> "StepSnapshot":
        # deep copies: a state_dict may hand out its live containers
        return cls(capture_rng_state(), {name: copy.deepcopy(obj.state_dict()) for name, obj in stateful.items()})

    def restore(self, stateful: Mapping[str, Any]) -> None:
        restore_rng_state(self.rng)
        for name, obj in stateful.items():
            obj.load_state_dict(copy.deepcopy(self.states[name]))
