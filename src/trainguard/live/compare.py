"""Bitwise comparison of two ranks' final states (parameters and optimizer state)."""

from __future__ import annotations

from typing import Any

import torch


def bitwise_differences(a: Any, b: Any, where: str = "") -> list[str]:
    """The paths at which two nested states differ in any bit (NaNs and signed zeros included)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [where or "."]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ"]
        return [d for key in a for d in bitwise_differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in bitwise_differences(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
