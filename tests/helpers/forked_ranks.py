"""Ranks of a test as processes of their own (forked, or spawned where CUDA state must not be inherited),
each writing ``ok<rank>`` or ``error<rank>`` (its traceback) into a results directory."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path


def run_forked_ranks(target: Callable[..., None], world: int, args: tuple, results: Path, timeout: float = 120,
                     start_method: str = "fork") -> None:
    """Runs ``target(rank, *args)`` for each rank in a process of its own, kills any still running after
    ``timeout`` seconds, and asserts that every rank wrote ``ok<rank>`` and none an error."""
    context = multiprocessing.get_context(start_method)
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [p.read_text() for p in sorted(results.glob("error*"))]
    assert not errors, "\n".join(errors)
    assert sorted(p.name for p in results.iterdir()) == [f"ok{rank}" for rank in range(world)]
