"""What a live run's events say about its samples and its quorum changes.

Every rank emits, for each step it computes, the sample ranges of its micro-batches (``live_samples``)
just before their gradients enter the step's sum, so a rank that dies once its rows are in the sum has
said so. A step whose sum failed, or that a survivor committed and then undid (``live_undo``), is
computed again in the next epoch, and the step is committed by the last epoch that computed it: for
each step the events of its newest epoch count. :func:`sample_problems` checks that those ranges tile
each step's global batch exactly: no sample lost, none repeated.
"""

from __future__ import annotations

from collections import defaultdict


def committed_ranges(events: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """step -> the sample ranges of the epoch that last committed it."""
    by_step: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event["kind"] == "live_samples":
            by_step[event["step"]][event["epoch"]].extend(tuple(r) for r in event["samples"])
    return {step: sorted(epochs[max(epochs)]) for step, epochs in by_step.items()}


def sample_problems(events: list[dict], steps: int, samples_per_step: int) -> list[str]:
    """One line per step whose committed samples are not exactly ``[step*G, (step+1)*G)``."""
    ranges = committed_ranges(events)
    problems = []
    for step in range(steps):
        expected, covered = step * samples_per_step, ranges.get(step, [])
        for first, end in covered:
            if first != expected:
                kind = "repeated" if first < expected else "lost"
                problems.append(f"step {step}: samples {kind} at {min(first, expected)}")
                break
            expected = end
        else:
            if expected != (step + 1) * samples_per_step:
                problems.append(f"step {step}: samples [{expected}, {(step + 1) * samples_per_step}) lost")
    return problems
