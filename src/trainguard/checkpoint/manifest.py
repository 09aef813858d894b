"""The manifest ``trainguard.json``: what a committed checkpoint holds, and the proof it is intact.

A checkpoint directory without a valid manifest does not exist: the manifest is written last, into
the not-yet-committed directory, and lists every file with its size and checksum.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM, file_checksum
from trainguard.fs.fsio import PathLike, atomic_write_json
from trainguard.fs.layout import MANIFEST_NAME
from trainguard.errors import CheckpointError

FORMAT = "trainguard-checkpoint"
VERSION = 1
# Hashing overlaps reads of several files; xxh3 itself outruns any disk.
DEFAULT_HASH_WORKERS = 4

_CHECKSUM = re.compile(rf"{CHECKSUM_ALGORITHM}:[0-9a-f]{{16}}")

Progress = Callable[[int], None]
"""Called with the byte count of each file once it is hashed (from worker threads)."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    """Relative to the checkpoint directory, ``/``-separated."""
    size: int
    checksum: str


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str


@dataclass
class Manifest:
    step: int
    world_size: int
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    files: list[FileEntry]
    trainer_state: dict[str, Any]
    created: float = field(default_factory=time.time)
    health: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for other tools (e.g. the roles a verl-style checkpoint holds)."""
    format: str = FORMAT
    version: int = VERSION

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": list(self.mesh_dim_names),
            "health": self.health,
            "trainer_state": self.trainer_state,
            "extra": self.extra,
            "files": [asdict(entry) for entry in self.files],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Raises ``ValueError`` saying what is wrong, naming the key."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, found {_json_type(data)}")
        # Format and version first: a newer manifest should say so, not report some missing key.
        file_format = _field(data, "format", "string")
        if file_format != FORMAT:
            raise ValueError(f"format is {file_format!r}, expected {FORMAT!r}")
        version = _field(data, "version", "integer")
        if version != VERSION:
            raise ValueError(f"version {version} is not supported (this trainguard reads version {VERSION})")
        health = data.get("health")
        if health is not None and not isinstance(health, dict):
            raise ValueError(f"key 'health' should be an object or null, found {_json_type(health)}")
        return cls(
            step=_field(data, "step", "integer"),
            created=float(_field(data, "created", "number")),
            world_size=_field(data, "world_size", "integer"),
            mesh_shape=_list_of(data, "mesh_shape", "integer"),
            mesh_dim_names=_list_of(data, "mesh_dim_names", "string"),
            files=_file_entries(data),
            trainer_state=_field(data, "trainer_state", "object"),
            health=health,
            extra=_field(data, "extra", "object") if "extra" in data else {},
        )


class ManifestError(CheckpointError):
    """A manifest that is missing or invalid; ``reason`` says what is wrong without the path."""

    def __init__(self, path: PathLike, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def build_manifest(
    ckpt_dir: PathLike,
    *,
    step: int,
    world_size: int,
    mesh_shape: list[int],
    mesh_dim_names: list[str],
    trainer_state: dict[str, Any],
    health: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    hash_workers: int = DEFAULT_HASH_WORKERS,
    progress: Progress | None = None,
    known: Mapping[str, FileEntry] | None = None,
) -> Manifest:
    """Describes every regular file under ``ckpt_dir`` (except the manifest), hashing them.

    ``known`` maps relative paths to entries whose checksums were computed as the files were written
    (by whichever rank wrote them); those files are not read again, only their sizes are checked.
    Every known file must be present with its known size: raises ``CheckpointError`` otherwise.
    """
    root = Path(ckpt_dir)
    found = _regular_files(root)
    known = dict(known or {})
    missing = sorted(set(known) - {relative for relative, _, _ in found})
    if missing:
        raise CheckpointError(f"{root}: {missing[0]!r} was written but is not there")
    for relative, _, size in found:
        if relative in known and known[relative].size != size:
            raise CheckpointError(
                f"{root}: {relative!r} has {size} bytes, but {known[relative].size} were written"
            )

    def hash_one(item: tuple[str, Path, int]) -> FileEntry:
        relative, path, size = item
        entry = known.get(relative) or FileEntry(relative, size, file_checksum(path))
        if progress is not None:
            progress(size)
        return entry

    with ThreadPoolExecutor(max_workers=hash_workers) as pool:
        files = list(pool.map(hash_one, found))
    return Manifest(
        step=step,
        world_size=world_size,
        mesh_shape=list(mesh_shape),
        mesh_dim_names=list(mesh_dim_names),
        files=files,
        trainer_state=trainer_state,
        health=health,
        extra=dict(extra or {}),
    )


def write_manifest(ckpt_dir: PathLike, manifest: Manifest) -> None:
    atomic_write_json(Path(ckpt_dir) / MANIFEST_NAME, manifest.to_dict())


def read_manifest(ckpt_dir: PathLike) -> Manifest:
    """Reads and validates the manifest; raises ``ManifestError`` naming the file and the fault."""
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(path, "missing (not a committed checkpoint)") from None
    except UnicodeDecodeError:
        raise ManifestError(path, "not valid UTF-8 text") from None
    except OSError as exc:
        raise ManifestError(path, f"cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(path, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    try:
        return Manifest.from_dict(data)
    except ValueError as exc:
        raise ManifestError(path, str(exc)) from None


def verify_checkpoint(
    ckpt_dir: PathLike,
    manifest: Manifest | None = None,
    *,
    hash_workers: int = DEFAULT_HASH_WORKERS,
    progress: Progress | None = None,
) -> list[BadFile]:
    """Checks every listed file's presence, size and checksum, and that no other file is present.

    Returns the faults sorted by path (empty when the checkpoint is intact). Reads the manifest
    when not given, raising ``ManifestError`` if it is invalid.
    """
    root = Path(ckpt_dir)
    if manifest is None:
        manifest = read_manifest(root)

    def check(entry: FileEntry) -> BadFile | None:
        reason = _file_fault(root / entry.path, entry)
        if progress is not None:
            progress(entry.size)
        return BadFile(entry.path, reason) if reason else None

    with ThreadPoolExecutor(max_workers=hash_workers) as pool:
        bad = [fault for fault in pool.map(check, manifest.files) if fault is not None]
    listed = {entry.path for entry in manifest.files}
    bad += [BadFile(relative, "unexpected file") for relative, _, _ in _regular_files(root) if relative not in listed]
    return sorted(bad, key=lambda fault: fault.path)


def _file_fault(path: Path, entry: FileEntry) -> str | None:
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_size != entry.size:
            return f"size {info.st_size} != expected {entry.size}"
        if file_checksum(path) != entry.checksum:
            return "checksum mismatch"
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return None


def _regular_files(root: Path) -> list[tuple[str, Path, int]]:
    """(relative posix path, path, size) of every regular file under ``root`` but the manifest."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names):
            path = Path(directory, name)
            info = os.lstat(path)
            relative = path.relative_to(root).as_posix()
            if stat.S_ISREG(info.st_mode) and relative != MANIFEST_NAME:
                found.append((relative, path, info.st_size))
    return found


_KIND_CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind in ("integer", "number", "string", "object", "list"):
        if _KIND_CHECKS[kind](value):
            return _a(kind)
    return type(value).__name__


def _field(data: dict[str, Any], key: str, kind: str, where: str = "") -> Any:
    if key not in data:
        raise ValueError(f"missing key '{where}{key}'")
    value = data[key]
    if not _KIND_CHECKS[kind](value):
        raise ValueError(f"key '{where}{key}' should be {_a(kind)}, found {_json_type(value)}")
    return value


def _list_of(data: dict[str, Any], key: str, kind: str) -> list[Any]:
    items = _field(data, key, "list")
    for index, item in enumerate(items):
        if not _KIND_CHECKS[kind](item):
            raise ValueError(f"key '{key}[{index}]' should be {_a(kind)}, found {_json_type(item)}")
    return list(items)


def _file_entries(data: dict[str, Any]) -> list[FileEntry]:
    entries = []
    seen = set()
    for index, item in enumerate(_field(data, "files", "list")):
        where = f"files[{index}]."
        if not isinstance(item, dict):
            raise ValueError(f"key 'files[{index}]' should be an object, found {_json_type(item)}")
        relative = _field(item, "path", "string", where)
        size = _field(item, "size", "integer", where)
        checksum = _field(item, "checksum", "string", where)
        pure = PurePosixPath(relative)
        # A manifest names files inside its checkpoint only; verification never looks elsewhere.
        if not relative or pure.is_absolute() or ".." in pure.parts or str(pure) != relative:
            raise ValueError(f"key '{where}path' is {relative!r}, not a normalized relative path")
        if relative in seen:
            raise ValueError(f"key '{where}path' lists {relative!r} twice")
        if size < 0:
            raise ValueError(f"key '{where}size' is negative ({size})")
        if not _CHECKSUM.fullmatch(checksum):
            raise ValueError(f"key '{where}checksum' is {checksum!r}, expected {CHECKSUM_ALGORITHM}:<16 hex digits>")
        seen.add(relative)
        entries.append(FileEntry(relative, size, checksum))
    return entries
