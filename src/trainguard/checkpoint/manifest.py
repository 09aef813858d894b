"""The manifest ``trainguard.json``: what a committed checkpoint holds, and the proof it is intact.

A checkpoint directory without a valid manifest does not exist: the manifest is written last, into
the not-yet-committed directory, and lists every file with its size and checksum.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

import xxhash

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM, file_checksum
from trainguard.fs.bounded import BoundedReadError, parse_json, read_regular_text
from trainguard.fs.fsio import PathLike, atomic_write_json
from trainguard.fs.layout import MANIFEST_NAME
from trainguard.fs.tree import TreeBoundError, walk_entries
from trainguard.errors import CheckpointError

FORMAT = "trainguard-checkpoint"
VERSION = 2
"""Version 2 adds ``manifest_checksum``; version 1 manifests (no checksum) are still read."""
READABLE_VERSIONS = (1, 2)
SELF_CHECKSUM_KEY = "manifest_checksum"
MAX_MANIFEST_BYTES = 64 << 20
# Hashing overlaps reads of several files; xxh3 itself outruns any disk.
DEFAULT_HASH_WORKERS = 4

_CHECKSUM = re.compile(rf"{CHECKSUM_ALGORITHM}:[0-9a-f]{{16}}")
# Per-rank files whose names carry the world size they were written for (fs.layout's names).
_RANK_FILE = re.compile(r"(extra_state|model|optim)_world_size_([0-9]+)_rank_([0-9]+)\.pt")

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
        """The manifest's JSON object, with the checksum of all its other fields (always the current version)."""
        data = {
            "format": self.format,
            "version": VERSION,
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
        data[SELF_CHECKSUM_KEY] = fields_checksum(data)
        return data

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
        if version not in READABLE_VERSIONS:
            raise ValueError(f"version {version} is not supported (this trainguard reads versions {READABLE_VERSIONS})")
        # Checked before any field is trusted: a hand-edited or damaged manifest says so here.
        if version >= 2:
            recorded = _field(data, SELF_CHECKSUM_KEY, "string")
            if recorded != fields_checksum(data):
                raise ValueError(f"key '{SELF_CHECKSUM_KEY}' does not match the manifest's fields (edited or damaged)")
        health = data.get("health")
        if health is not None and not isinstance(health, dict):
            raise ValueError(f"key 'health' should be an object or null, found {_json_type(health)}")
        manifest = cls(
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
        inconsistency = manifest_inconsistency(manifest)
        if inconsistency:
            raise ValueError(inconsistency)
        return manifest


def fields_checksum(data: Mapping[str, Any]) -> str:
    """Checksum of a manifest's fields but the checksum itself, over their canonical JSON. NaN stays
    allowed: a trainer state may hold a NaN loss (a step-0 save, a save after a skipped step), and
    Python's JSON writes and reads it back as the same token."""
    fields = {key: value for key, value in data.items() if key != SELF_CHECKSUM_KEY}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64(canonical.encode()).hexdigest()}"


def manifest_inconsistency(manifest: Manifest) -> str | None:
    """Why the fields that decide how a checkpoint is loaded contradict each other or its file list."""
    if manifest.step < 0:
        return f"step is negative ({manifest.step})"
    if manifest.world_size < 1:
        return f"world_size is {manifest.world_size}, expected ≥ 1"
    if manifest.mesh_shape:
        if len(manifest.mesh_shape) != len(manifest.mesh_dim_names):
            return f"mesh_shape {manifest.mesh_shape} and mesh_dim_names {manifest.mesh_dim_names} differ in length"
        if any(degree < 1 for degree in manifest.mesh_shape) or math.prod(manifest.mesh_shape) != manifest.world_size:
            return f"mesh_shape {manifest.mesh_shape} does not multiply to world_size {manifest.world_size}"
    ranks_by_kind: dict[str, set[int]] = {}
    for entry in manifest.files:
        match = _RANK_FILE.fullmatch(entry.path)
        if match is None:
            continue
        kind, world_size, rank = match.group(1), int(match.group(2)), int(match.group(3))
        if world_size != manifest.world_size:
            return f"lists {entry.path} but records world_size {manifest.world_size}"
        ranks_by_kind.setdefault(kind, set()).add(rank)
    for kind, ranks in ranks_by_kind.items():
        if ranks != set(range(manifest.world_size)):
            missing = sorted(set(range(manifest.world_size)) - ranks)
            return f"world_size {manifest.world_size} but no {kind} file of rank {missing[0] if missing else max(ranks)}"
    step = manifest.trainer_state.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step != manifest.step:
        return f"step {manifest.step} but trainer_state.step {step}"
    return None


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


def write_manifest(ckpt_dir: PathLike, manifest: Manifest, *, sync_dir: bool = True, sync_file: bool = True) -> None:
    """``sync_dir``, ``sync_file``: as ``fsio.atomic_write_bytes``'s."""
    atomic_write_json(Path(ckpt_dir) / MANIFEST_NAME, manifest.to_dict(), sync_dir=sync_dir, sync_file=sync_file)


def read_manifest(ckpt_dir: PathLike) -> Manifest:
    """Reads and validates the manifest; raises ``ManifestError`` naming the file and the fault."""
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        text = read_regular_text(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(path, "missing (not a committed checkpoint)") from None
    except UnicodeDecodeError:
        raise ManifestError(path, "not valid UTF-8 text") from None
    except BoundedReadError as exc:
        raise ManifestError(path, str(exc)) from None
    except OSError as exc:
        raise ManifestError(path, f"cannot read ({exc.strerror})") from None
    try:
        data = parse_json(text)
    except ValueError as exc:
        raise ManifestError(path, str(exc)) from None
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
    faulty = {fault.path for fault in bad}
    try:
        entries = checkpoint_entries(root)
    except TreeBoundError as exc:
        bad.append(BadFile(exc.path.relative_to(root).as_posix(), exc.reason))
        entries = []
    for relative, kind in entries:
        if relative in faulty:
            continue
        if kind == "file" and relative not in listed:
            bad.append(BadFile(relative, "unexpected file"))
        elif kind not in ("file", "directory"):
            bad.append(BadFile(relative, f"not a regular file ({kind})"))
        elif kind == "directory" and not any(path.startswith(relative + "/") for path in listed):
            bad.append(BadFile(relative, "unexpected directory"))
    return sorted(bad, key=lambda fault: fault.path)


def checkpoint_entries(root: Path) -> list[tuple[str, str]]:
    """(relative posix path, kind) of every entry under ``root`` but the manifest, never following a
    link; kind is file, directory, symlink, fifo, socket, device or other."""
    return [(relative, entry_kind(info.st_mode)) for relative, _, info in walk_entries(root)
            if relative != MANIFEST_NAME]


def entry_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


def _file_fault(path: Path, entry: FileEntry) -> str | None:
    try:
        # lstat: a listed file replaced by a link is refused, never followed outside the checkpoint.
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return f"not a regular file ({entry_kind(info.st_mode)})"
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
    return [(relative, path, info.st_size) for relative, path, info in walk_entries(root)
            if stat.S_ISREG(info.st_mode) and relative != MANIFEST_NAME]


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
