"""Walking a directory tree that may be hostile (a checkpoint someone else wrote): without recursion,
never following a link, with its depth and the count of entries read bounded, so 1,500 nested
directories or a million planted files end in one ``CheckpointError`` line instead of a
``RecursionError`` or an exhausted memory."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from trainguard.errors import CheckpointError

MAX_TREE_DEPTH = 64
"""Every layout trainguard reads or writes nests a few levels; hostile trees are refused far above that."""
MAX_TREE_ENTRIES = 1_000_000
"""A durable checkpoint holds a few files per rank; this is that for hundreds of thousands of ranks."""


class TreeBoundError(CheckpointError):
    """A tree past a bound: ``path`` is the directory at fault, ``reason`` says which bound."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def walk_entries(root: Path, max_depth: int = MAX_TREE_DEPTH,
                 max_entries: int = MAX_TREE_ENTRIES) -> Iterator[tuple[str, Path, os.stat_result]]:
    """(relative posix path, path, ``lstat``) of every entry under ``root``, in the order of
    ``os.walk(root)`` with its directories sorted: a directory's entries sorted by name, then its
    subdirectories in turn. Links are reported, never followed. Raises ``TreeBoundError`` naming the
    directory at fault past ``max_depth`` levels or ``max_entries`` entries."""
    root = Path(root)
    pending: list[tuple[Path, int]] = [(root, 0)]
    read = 0
    while pending:
        directory, depth = pending.pop()
        if depth >= max_depth:
            raise TreeBoundError(directory, f"directories nested deeper than {max_depth} levels")
        names = []
        with os.scandir(directory) as listing:
            for entry in listing:
                read += 1
                if read > max_entries:
                    raise TreeBoundError(directory, f"more than {max_entries} entries under {root}")
                names.append(entry.name)
        subdirs = []
        for name in sorted(names):
            path = directory / name
            info = os.lstat(path)
            yield path.relative_to(root).as_posix(), path, info
            if stat.S_ISDIR(info.st_mode):  # lstat: a link to a directory is not one
                subdirs.append(path)
        pending.extend((subdir, depth + 1) for subdir in reversed(subdirs))


def remove_tree(root: Path) -> None:
    """Deletes ``root`` and everything under it, at any depth, without recursion (``shutil.rmtree``
    recurses: a ``RecursionError`` on a hostile tree 1,500 levels deep), never following a link. A
    tree to delete is ours (a trash or temp directory): no bound on its depth or size."""
    root = Path(root)
    directories = [root]  # each before the directories under it
    for _, path, info in walk_entries(root, max_depth=sys.maxsize, max_entries=sys.maxsize):
        if stat.S_ISDIR(info.st_mode):
            directories.append(path)
        else:
            path.unlink()
    for directory in reversed(directories):
        directory.rmdir()
