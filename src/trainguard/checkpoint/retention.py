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


def retention_after_commit(
    steps: Iterable[int],
    committed: int,
    unhealthy: Iterable[int],
    keep_last: int,
    keep_every: int | None = None,
) -> list[int]:
    """Steps to delete once ``committed`` is committed.

    Only the run's own timeline (steps up to ``committed``) is pruned: checkpoints newer than it come
    from a timeline the run resumed away from and stay until the run redoes their step. The newest
    healthy checkpoint is kept even when newer unhealthy ones fill the ``keep_last`` slots.
    """
    timeline = sorted(s for s in set(steps) if s <= committed)
    bad = set(unhealthy)
    newest_healthy = max((s for s in timeline if s not in bad), default=None)
    return [s for s in select_for_deletion(timeline, keep_last, keep_every) if s != newest_healthy]
