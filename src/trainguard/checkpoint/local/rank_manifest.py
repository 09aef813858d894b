"""A rank's manifest in a local step directory: the rank's files with sizes and checksums.

``global_step_N/manifest_world_size_W_rank_R.json`` is written last, atomically; a rank's local
checkpoint of step N exists only while its manifest does (the durable tier's commit rule, per rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHMS, checksum_matches
from trainguard.fs.bounded import read_format_json
from trainguard.fs.fsio import atomic_write_json
from trainguard.checkpoint.local.paths import rank_manifest_name
from trainguard.checkpoint.manifest import FileEntry
from trainguard.errors import CheckpointError

FORMAT = "trainguard-local-rank"
VERSION = 1


@dataclass(frozen=True)
class RankManifest:
    step: int
    rank: int
    world_size: int
    files: tuple[FileEntry, ...]

    def entry(self, path: str) -> FileEntry | None:
        return next((e for e in self.files if e.path == path), None)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "rank": self.rank,
                "world_size": self.world_size, "files": [asdict(e) for e in self.files]}


def write_rank_manifest(step_dir: Path, manifest: RankManifest) -> None:
    atomic_write_json(step_dir / rank_manifest_name(manifest.world_size, manifest.rank), manifest.to_dict())


def _integer(data: dict, key: str, path: Path) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{path}: key {key!r} should be a non-negative integer, found {value!r}")
    return value


def read_rank_manifest(path: Path) -> RankManifest:
    """Reads and validates one rank manifest; raises ``CheckpointError`` naming the file and the fault."""
    data = read_format_json(path, FORMAT, VERSION, "local rank manifest")
    files = data.get("files")
    if not isinstance(files, list):
        raise CheckpointError(f"{path}: key 'files' should be a list")
    entries = []
    for index, item in enumerate(files):
        if not (isinstance(item, dict) and isinstance(item.get("path"), str) and isinstance(item.get("size"), int)
                and isinstance(item.get("checksum"), str)):
            raise CheckpointError(f"{path}: key 'files[{index}]' should be {{path, size, checksum}}")
        pure = PurePosixPath(item["path"])
        if pure.is_absolute() or ".." in pure.parts or str(pure) != item["path"]:
            raise CheckpointError(f"{path}: key 'files[{index}].path' is {item['path']!r}, not a relative path")
        entries.append(FileEntry(item["path"], item["size"], item["checksum"]))
    return RankManifest(_integer(data, "step", path), _integer(data, "rank", path),
                        _integer(data, "world_size", path), tuple(entries))


def file_fault(step_dir: Path, entry: FileEntry, *, hashed: bool = True) -> str | None:
    """Why ``entry``'s file in ``step_dir`` is not what the manifest says, None when it is (with
    ``hashed=False``: when it is present with the right size)."""
    path = step_dir / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry.size:
        return f"size {size} != expected {entry.size}"
    if entry.checksum.partition(":")[0] not in CHECKSUM_ALGORITHMS:
        return f"checksum {entry.checksum!r} of an unknown algorithm"
    if hashed and not checksum_matches(path, entry.checksum):
        return "checksum mismatch"
    return None
