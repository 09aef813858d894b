"""Damage to committed checkpoint files: one flipped byte, a cut in half, a deletion."""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from trainguard.fs.fsio import fsync_dir


def matching_files(directory: Path, pattern: str) -> list[Path]:
    """Regular files under ``directory`` whose relative posix path or basename matches ``pattern``.

    Symlinks are left out: damaging one would damage a file outside the checkpoint.
    """
    found = []
    for path in sorted(Path(directory).rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        relative = path.relative_to(directory).as_posix()
        if fnmatchcase(relative, pattern) or fnmatchcase(path.name, pattern):
            found.append(path)
    return found


def corrupt_file(path: Path) -> dict[str, Any]:
    """Inverts every bit of the middle byte; an empty file has no byte to flip and is left as is."""
    size = path.stat().st_size
    if size == 0:
        return {"offset": None, "size": 0}
    offset = size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return {"offset": offset, "size": size, "old_byte": old, "new_byte": old ^ 0xFF}


def truncate_file(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
        os.fsync(f.fileno())
    return {"size": size, "new_size": size // 2}


def delete_file(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    path.unlink()
    fsync_dir(path.parent)
    return {"size": size}


DAMAGE = {"corrupt": corrupt_file, "truncate": truncate_file, "delete": delete_file}
