"""Ranks of a real gloo group as threads of the test's process (a ``HashStore``): for unit tests of
collectives on tiny tensors, without starting processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def run_ranks(ranks: list[int], work: Callable[[dist.ProcessGroup, int], T]) -> dict[int, T]:
    """``work(group, rank)`` on one gloo group of ``ranks`` (the group's ranks are their indices), each
    in its own thread; the results by rank, or the first error raised."""
    store = dist.HashStore()
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def main(index: int, rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, index, len(ranks), timedelta(seconds=30))
            results[rank] = work(group, rank)
        except BaseException as error:  # surfaced in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=main, args=(index, rank)) for index, rank in enumerate(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results
