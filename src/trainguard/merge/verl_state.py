"""verl's extra state (``extra_state_world_size_W_rank_R.pt`` of its ``FSDPCheckpointManager``) in
trainguard's form, so that a converted verl checkpoint resumes in trainguard's loop.

verl saves ``{"lr_scheduler": scheduler.state_dict(), "rng": {"cpu", "cuda"?, "numpy", "random"}}``;
trainguard's extra state is ``{"step", "rank", "world_size", "rng": {"python", "numpy": {kind, keys,
pos, has_gauss, cached_gaussian}, "torch", "cuda"?}, "stateful": {"scheduler": ...}}``
(docs/checkpoints.md). The scheduler's state goes under ``scheduler``, the reference trainer's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def is_verl_extra_state(state: Any) -> bool:
    rng = state.get("rng") if isinstance(state, dict) else None
    return isinstance(rng, dict) and {"cpu", "numpy", "random"} <= set(rng) and "step" not in state


def trainguard_extra_state(state: dict[str, Any], *, step: int, rank: int, world_size: int) -> dict[str, Any]:
    rng = state["rng"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    converted_rng: dict[str, Any] = {
        "python": rng["random"],
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": rng["cpu"],
    }
    if rng.get("cuda") is not None:
        converted_rng["cuda"] = rng["cuda"]
    stateful = {"scheduler": state["lr_scheduler"]} if state.get("lr_scheduler") is not None else {}
    return {"step": step, "rank": rank, "world_size": world_size, "rng": converted_rng, "stateful": stateful}
