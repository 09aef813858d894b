"""A failure of one rank made every rank's: all raise it alike, so none is left waiting in a collective
for the others and rank 0 alone reports it, in one line."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from trainguard.errors import TrainguardError, failure_of_rank


def raise_if_any_rank_failed(failure: TrainguardError | None) -> None:
    """Called by every rank with its own failure (or None): every rank raises when any rank failed, with
    the first failing rank's message and exit code. A collective: every rank must call it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (str(failure), failure.exit_code) if failure is not None else None)
    for rank, report in enumerate(reports):
        if report is not None:
            raise failure_of_rank(rank, *report)
