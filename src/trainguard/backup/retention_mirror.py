"""Which mirrored checkpoints to delete: the mirror tier keeps everything, or only multiples of
``keep_every``, and always its newest checkpoint and its newest healthy one."""

from __future__ import annotations

from collections.abc import Iterable


def mirror_deletions(steps: Iterable[int], keep_every: int | None, unhealthy: Iterable[int] = ()) -> list[int]:
    """Mirrored steps to delete, ascending (none when ``keep_every`` is None)."""
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    ordered = sorted(set(steps))
    if keep_every is None or not ordered:
        return []
    bad = set(unhealthy)
    kept = {ordered[-1], max((s for s in ordered if s not in bad), default=ordered[-1])}
    return [s for s in ordered if s % keep_every != 0 and s not in kept]
