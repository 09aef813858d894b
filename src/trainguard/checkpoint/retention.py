"""Which checkpoints to delete: keep the last K intermediate ones, every M-th for ever, and never the
newest nor a protected one (such as the newest healthy checkpoint)."""

from __future__ import annotations

from collections.abc import Iterable


def select_for_deletion(
    steps: Iterable[int],
    keep_last: int,
    keep_every: int | None = None,
    protected: Iterable[int] = frozenset(),
) -> list[int]:
    """Steps to delete, ascending.

    Multiples of ``keep_every`` (step 0 included) and ``protected`` steps are kept for ever; of the
    other steps the newest ``keep_last`` are kept, which always includes the newest step overall
    unless it is already kept for ever.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    kept_forever = set(protected)
    intermediate = []
    for step in sorted(set(steps)):
        if step in kept_forever or (keep_every is not None and step % keep_every == 0):
            continue
        intermediate.append(step)
    return intermediate[:-keep_last]
