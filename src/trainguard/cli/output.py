"""What the commands print besides their results: progress bars and warnings, on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def byte_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    # rich is imported here, not at the top: every command that may draw a bar imports this module
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        yield lambda count: progress.advance(task, count)


def warn(message: str) -> None:
    print(f"trainguard: warning: {message}", file=sys.stderr)
