"""Crash-safe file system primitives: a crash at any instant leaves either the old or the new state.

Each function fsyncs what it creates and the directory entry that names it, because a rename that is
not yet on disk can be undone by a power loss even after the call returned.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainguard.fs.layout import TEMP_MARKER, is_transient_name, new_token, trash_name
from trainguard.fs.tree import remove_tree
from trainguard.errors import CheckpointError

PathLike = str | os.PathLike


def fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Makes creations, renames and removals of the directory's entries durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: PathLike, data: bytes, *, sync_dir: bool = True, sync_file: bool = True) -> None:
    """Replaces ``path`` with ``data`` so that readers see the old or the new content, never a mix.
    ``sync_dir=False``: the caller fsyncs ``path``'s directory itself (one fsync for several entries).
    ``sync_file=False``: the caller fsyncs ``path`` itself before anything depends on it being durable
    (a file of a directory not yet published, fsynced together with the others: ``fsync_all``)."""
    path = Path(path)
    temp = path.with_name(f"{path.name}{TEMP_MARKER}{new_token()}")
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            if sync_file:
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8", *, sync_dir: bool = True,
                      sync_file: bool = True) -> None:
    atomic_write_bytes(path, text.encode(encoding), sync_dir=sync_dir, sync_file=sync_file)


def atomic_write_json(path: PathLike, obj: Any, indent: int | None = 2, *, sync_dir: bool = True,
                      sync_file: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n", sync_dir=sync_dir, sync_file=sync_file)


def tree_directories(root: PathLike) -> list[Path]:
    """Every directory under ``root`` (links not followed), deepest first, then ``root`` itself."""
    root = Path(root)
    return [path for path in sorted(root.rglob("*"), reverse=True) if path.is_dir() and not path.is_symlink()] + [root]


def fsync_tree(root: PathLike) -> None:
    """Makes every directory entry under ``root`` durable, deepest first, then ``root``'s own entries
    (files' contents are their writers' to fsync)."""
    for directory in tree_directories(root):
        fsync_dir(directory)


FSYNC_THREADS = 16


def fsync_all(paths: Iterable[PathLike]) -> None:
    """Fsyncs every file and directory of ``paths`` (directories: their entries), all at once from
    threads; returns when every one is durable, raises the first failure. For things whose order on
    disk does not matter, only that all of them are there before what comes next (a checkpoint's files
    and directories before its publishing rename). Issued together, the file system commits them in
    one or a few journal transactions; one after the other, each fsync of a new file or directory
    waits for a journal commit of its own (several ms on a busy disk)."""
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            _fsync_path(path)
        return
    with ThreadPoolExecutor(max_workers=min(FSYNC_THREADS, len(paths)), thread_name_prefix="trainguard-fsync") as pool:
        for done in [pool.submit(_fsync_path, path) for path in paths]:
            done.result()


def _fsync_path(path: PathLike) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        fsync_dir(path)
    else:
        fsync_file(path)


def commit_directory(temp_dir: PathLike, final_dir: PathLike, *, replace: bool = False,
                     sync_parent: bool = True) -> bool:
    """Publishes a fully written (and already fsynced) directory under its final name; returns whether
    an existing ``final_dir`` was replaced.

    Without ``replace`` an existing ``final_dir`` is refused: on Linux, rename silently replaces an
    empty directory, and a committed checkpoint must never be overwritten by accident. With it, the old
    directory is first deleted crash-safely (a crash leaves a ``.trash-*`` leftover, never a mix).
    ``sync_parent=False``: the caller fsyncs ``final_dir``'s parent itself, after more entries of its own.
    """
    temp_dir, final_dir = Path(temp_dir), Path(final_dir)
    replaced = False
    if os.path.lexists(final_dir):
        if not replace:
            raise CheckpointError(f"cannot commit {temp_dir}: {final_dir} already exists")
        remove_directory_crash_safe(final_dir)
        replaced = True
    os.rename(temp_dir, final_dir)
    if sync_parent:
        fsync_dir(final_dir.parent)
    if temp_dir.parent.resolve() != final_dir.parent.resolve():
        fsync_dir(temp_dir.parent)
    return replaced


def remove_directory_crash_safe(path: PathLike) -> None:
    """Deletes a directory so that a crash midway leaves a ``.trash-*`` leftover, never a half-deleted
    directory under its original (possibly committed-looking) name."""
    delete_retired([retire_directory(path)])


def retire_directory(path: PathLike) -> Path:
    """The first half of ``remove_directory_crash_safe``: renames the directory to a ``.trash-*`` name
    beside it and returns that name; from then on it is gone for every reader of this file system.
    The rename is not yet durable: ``delete_retired`` makes it so before deleting anything, and a crash
    before that brings the directory back whole under its name."""
    path = Path(path)
    trash = path.with_name(trash_name(path.name))
    os.rename(path, trash)
    return trash


def delete_retired(retired: Sequence[Path]) -> None:
    """The second half: makes the renames of ``retire_directory`` durable (one fsync of each parent),
    then deletes the retired trees; a crash midway leaves ``.trash-*`` leftovers (``clean_stale``)."""
    for parent in dict.fromkeys(trash.parent for trash in retired):
        fsync_dir(parent)
    for trash in retired:
        remove_tree(trash)


def clean_stale(root: PathLike) -> list[Path]:
    """Removes leftovers of interrupted writes (``*.tmp-*``) and deletes (``.trash-*``) directly under
    ``root``; returns them sorted. Call only when no save is in flight: an in-flight save's temp
    directory is indistinguishable from an abandoned one."""
    removed = []
    for entry in sorted(Path(root).iterdir()):
        if not is_transient_name(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
        else:
            entry.unlink()
        removed.append(entry)
    return removed


SYNC_FILE_RANGE_WRITE = 2


def _linux_libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The C library's function ``name`` on Linux (returning an int), None elsewhere or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


# Linux's sync_file_range (None elsewhere): start writing back a finished range while later bytes are
# still being produced, so the closing fsync has little left to do.
sync_file_range = _linux_libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


_MEMORY_FILE_SYSTEMS = {0x01021994, 0x858458F6}  # tmpfs, ramfs (statfs's f_type)


_fstatfs = _linux_libc("fstatfs", [ctypes.c_int, ctypes.c_void_p])


def in_memory_file_system(fd: int) -> bool:
    """Whether the open file ``fd`` lives in node memory (tmpfs, ramfs: ``/dev/shm``), where its pages
    are the file itself; False where it cannot be told (not Linux)."""
    if _fstatfs is None:
        return False
    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type comes first
    if _fstatfs(fd, buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value in _MEMORY_FILE_SYSTEMS
