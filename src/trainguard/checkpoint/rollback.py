"""Rollback (``check_for_global_norm``): the I/O side of ``guards/rollback.py``, for both step engines (the
closure mode's ``step/plugins/spike_rollback.py``, live mode's ``live/rollback.py``).

Every rank arrives here at the same step with the same spike: the verdict came from values that rode
the step's all-reduce, and the guard state is identical on every rank. The policy says which steps'
batches to skip; the checkpoint manager restores the newest healthy checkpoint from before the spike
(after the save in flight has committed); the data then never yields the skipped global positions,
on any layout, and saves them in every later checkpoint so they stay skipped after restarts.

The data object must be able to skip ranges of global sample positions: ``SkippableData``, which the
reference trainer's ``StatefulSampler`` implements (live mode: ``live/rollback.DataPositions``, whose
positions are the data positions handed to ``loss_of``). The checkpoints are anything that restores the
newest healthy one before a step (``RestoresBefore``: ``CheckpointManager``; live mode's quorum).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.guards.rollback import RollbackAbort, RollbackGuard, Spike

log = logging.getLogger("trainguard")


@runtime_checkable
class SkippableData(Protocol):
    """A data source whose position is a global sample position and which can skip ranges of them.

    ``consumed_samples``: the global position of the next sample (over every data-parallel rank);
    ``skipped``: the skipped ``[start, end)`` ranges, sorted; ``skip(start, end)``: never yield those
    positions (saved in ``state_dict``); ``span_ahead(after, count)``: the positions spanning the
    ``count`` samples yielded after the next ``after``; ``ranges_between(start, end)``: the positions
    in ``[start, end)`` that are not skipped.
    """

    consumed_samples: int
    skipped: list[tuple[int, int]]

    def skip(self, start: int, end: int) -> None: ...

    def span_ahead(self, after: int, count: int) -> tuple[int, int]: ...

    def ranges_between(self, start: int, end: int) -> list[tuple[int, int]]: ...


class SkippedPositions:
    """A cursor over global positions that never yields the skipped ranges: ``SkippableData``'s arithmetic,
    for the reference trainer's sampler (many positions a step) and live mode's data positions (one a step)."""

    def __init__(self) -> None:
        self.consumed_samples = 0
        self.skipped: list[tuple[int, int]] = []  # sorted, disjoint, non-adjacent [start, end) positions

    def take(self, cursor: int, count: int) -> tuple[list[tuple[int, int]], int]:
        """The ranges of the next ``count`` non-skipped positions from ``cursor``, and the cursor after them."""
        ranges: list[tuple[int, int]] = []
        for start, end in self.skipped:
            if count == 0 or cursor < start and cursor + count <= start:
                break
            if end <= cursor:
                continue
            if cursor < start:
                ranges.append((cursor, start))
                count -= start - cursor
            cursor = end
        if count:
            ranges.append((cursor, cursor + count))
            cursor += count
        return ranges, cursor

    def span_ahead(self, after: int, count: int) -> tuple[int, int]:
        """The global positions ``[start, end)`` spanning the ``count`` samples that will be yielded after
        the next ``after`` ones (skipped ranges inside the span are already excluded from it)."""
        if after < 0 or count < 1:
            raise ValueError(f"need after >= 0 and count >= 1, got after={after} count={count}")
        _, cursor = self.take(self.consumed_samples, after)
        ranges, _ = self.take(cursor, count)
        return ranges[0][0], ranges[-1][1]

    def skip(self, start: int, end: int) -> None:
        """Never yields global positions ``[start, end)``: merged into the skipped ranges."""
        if not 0 <= start < end:
            raise ValueError(f"need 0 <= start < end, got [{start}, {end})")
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.skipped, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.skipped = merged

    def ranges_between(self, start: int, end: int) -> list[tuple[int, int]]:
        """The positions in ``[start, end)`` that are not skipped, as ranges (what a cursor moving from
        ``start`` to ``end`` has yielded)."""
        ranges: list[tuple[int, int]] = []
        for a, b in self.skipped:
            if b <= start:
                continue
            if a >= end:
                break
            if start < a:
                ranges.append((start, a))
            start = max(start, b)
        if start < end:
            ranges.append((start, end))
        return ranges

    @property
    def skipped_samples(self) -> int:
        return sum(end - start for start, end in self.skipped)


class RestoresBefore(Protocol):
    def roll_back(self, before_step: int) -> int | None:
        """Restores the newest healthy checkpoint of a step before ``before_step``: its step, None when none."""


def skippable_data(stateful: Mapping[str, Any]) -> SkippableData:
    """The one stateful object rollback mode skips samples with; ConfigError when there is none."""
    found = [obj for obj in stateful.values() if isinstance(obj, SkippableData)]
    if len(found) != 1:
        names = ", ".join(repr(name) for name in stateful) or "none"
        what = "none" if not found else f"{len(found)}"
        raise ConfigError(
            "guards.check_for_global_norm (rollback mode) needs exactly one stateful data object that can skip "
            f"sample ranges (trainguard.step.SkippableData: consumed_samples, skipped, skip, span_ahead, "
            f"ranges_between); {what} of the stateful objects ({names}) implements it")
    return found[0]


def roll_back(spike: Spike, guard: RollbackGuard, data: SkippableData, checkpoints: RestoresBefore, events: EventLog,
              reports: bool, samples_per_step: int) -> int:
    """Restores the checkpoint, skips the window's samples and returns the restored step; raises
    RollbackAbort (exit 3) when the spike recurred too often or nothing precedes it.
    ``samples_per_step``: the global samples one step draws; ``reports``: this rank writes the events.
    """
    try:
        plan = guard.plan(spike)
        policy = guard.policy_state()
        skipped_before = list(data.skipped)
        restored = checkpoints.roll_back(before_step=spike.step)
        if restored is None:
            raise RollbackAbort(guard.abort_summary(spike, "there is no healthy checkpoint before it to roll back to"))
    except RollbackAbort as abort:
        log.error("%s", abort)
        if reports:
            events.emit("rollback_abort", step=spike.step, metric=spike.metric, value=spike.value,
                        threshold=spike.threshold, message=str(abort))
        raise
    # The checkpoint brought back its own guard and data state; the rollbacks made since must stay.
    guard.restore_policy_state(policy)
    for start, end in skipped_before:
        data.skip(start, end)
    first = guard.starts_after(restored)
    start, end = data.span_ahead((first - restored - 1) * samples_per_step,
                                 (plan.last_step - first + 1) * samples_per_step)
    data.skip(start, end)
    log.warning(
        "rollback: %s %s of step %d is greater than threshold %r: restored global_step_%d and skipping the "
        "batches of steps %d-%d (global samples [%d, %d)), rollback %d of at most %d without progress",
        spike.metric, f"[{spike.value:.6f}]", spike.step, float(spike.threshold), restored, first, plan.last_step,
        start, end, plan.attempt, guard.cfg.max_rollbacks,
    )
    if reports:
        events.emit(
            "rollback", step=spike.step, to_step=restored, metric=spike.metric, value=spike.value,
            threshold=spike.threshold, window=[first, plan.last_step], attempt=plan.attempt,
            skipped=[[start, end]], skipped_ranges=[list(r) for r in data.skipped],
            skipped_samples=sum(b - a for a, b in data.skipped),
        )
    return restored
