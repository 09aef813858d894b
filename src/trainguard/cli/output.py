"""What the commands print besides their results: progress bars and warnings, on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

# Piped output is read by tools and people with wide windows: never squeezed into 80 columns
PIPED_WIDTH = 200


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


def stdout_console(piped_width: int = PIPED_WIDTH) -> Console:
    """The console a command prints its results on: ``piped_width`` columns when stdout is no terminal. A
    reader that leaves (``trainguard status DIR | head -1``) raises ``BrokenPipeError``, which ``cli.main``
    ends quietly with exit 141 as it does for ``print``, instead of rich's own exit 1."""
    from rich.console import Console

    class ResultConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    console = ResultConsole()
    return console if console.is_terminal else ResultConsole(width=piped_width)


def warn(message: str) -> None:
    print(f"trainguard: warning: {message}", file=sys.stderr)
