"""Writing a result directory all or nothing: into a hidden sibling, renamed into place when complete."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainguard.fs.fsio import commit_directory, fsync_tree
from trainguard.fs.layout import new_token
from trainguard.errors import ConfigError


def check_target(target: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ConfigError(f"{target}: exists and is not empty (pass --force to replace it)")


@contextmanager
def staged_directory(target: Path, force: bool) -> Iterator[Path]:
    """Yields a fresh directory to fill; on success it replaces ``target``, on any failure it is removed
    and ``target`` is left as it was."""
    target = Path(target).absolute()
    check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{new_token()}"
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        commit_directory(staging, target, replace=True)  # check_target allowed what is there
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
