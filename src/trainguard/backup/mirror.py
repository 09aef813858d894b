"""Uploading a committed checkpoint to a mirror so that it becomes visible only when complete.

Protocol (a crash or kill at any instant leaves nothing that looks complete):
1. every file of the local manifest is uploaded to ``URL/global_step_N/<path>`` unless an identical
   object is already there (what an interrupted backup left); while it uploads it is hashed (xxh3,
   compared with the manifest, so a corrupted local file is never mirrored; and, for S3, CRC32 or,
   for a multipart upload, MD5 in the client's part layout);
2. once all are uploaded, one listing gives each object's size, and each object's checksum must
   match the local bytes: on S3 the CRC32 the server verified on receipt and stored (one HEAD), or
   the multipart ETag; where the store keeps neither, the object is read back and its xxh3 compared
   with the manifest;
3. objects under ``global_step_N/`` that the manifest does not list are removed;
4. the manifest ``trainguard.json`` is uploaded last, in one request: a mirrored checkpoint without
   a valid manifest does not exist (the same rule as on local disk).
A step already mirrored with a different manifest (a redone step) loses its manifest first.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash
from fsspec.callbacks import Callback

from trainguard.backup.throttle import Throttle
from trainguard.backup.url import Mirror, MirrorError, describe_error
from trainguard.checkpoint.checksum import CHECKSUM_ALGORITHM
from trainguard.fs.layout import MANIFEST_NAME, parse_step_dir, step_dir_name
from trainguard.checkpoint.manifest import FileEntry, Manifest, read_manifest
from trainguard.errors import CheckpointError

Progress = Callable[[int], None]

# Parts of this size, passed to the client explicitly so that the multipart ETag can be predicted.
PART_SIZE = 50 << 20
_READ = 8 << 20


@dataclass(frozen=True)
class MirrorResult:
    step: int
    url: str
    bytes_total: int
    bytes_uploaded: int
    files_uploaded: int
    files_reused: int
    seconds: float
    already_complete: bool = False


@dataclass(frozen=True)
class _LocalDigest:
    checksum: str
    crc32: str | None = None
    """For S3 objects sent in one PUT: the CRC32 (base64) the client sends and the server checks and
    stores (S3's flexible checksums)."""
    etag: str | None = None
    """For S3 multipart uploads: the ETag S3 computes, the MD5 of the parts' MD5s with ``-<parts>``."""


def _single_put_limit(size: int) -> bool:
    """True when the S3 client sends the file in one PUT (s3fs: below two parts and 5 GiB)."""
    return size < min(5 << 30, 2 * _part_size(size))


def _part_size(size: int) -> int:
    try:
        from s3fs.core import calculate_chunksize
    except ImportError:
        return PART_SIZE
    return calculate_chunksize(size, chunksize=PART_SIZE)


def local_digest(path: Path, size: int, for_s3: bool) -> _LocalDigest:
    """xxh3 of the file and, for S3, what the server will report for it: the CRC32 of a single PUT,
    or the multipart ETag."""
    digest = xxhash.xxh3_64()
    single = _single_put_limit(size)
    part_size = _part_size(size)
    crc = 0 if for_s3 and single else None
    parts: list[bytes] = []
    part = hashlib.md5(usedforsecurity=False) if for_s3 and not single else None
    in_part = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(min(_READ, part_size - in_part) if part is not None else _READ)
            if not chunk:
                break
            digest.update(chunk)
            if crc is not None:
                crc = zlib.crc32(chunk, crc)
            if part is not None:
                part.update(chunk)
                in_part += len(chunk)
                if in_part == part_size:
                    parts.append(part.digest())
                    part, in_part = hashlib.md5(usedforsecurity=False), 0
    etag = None
    if part is not None:
        if in_part:
            parts.append(part.digest())
        etag = f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"
    crc32 = base64.b64encode(crc.to_bytes(4, "big")).decode() if crc is not None else None
    return _LocalDigest(f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}", crc32, etag)


def remote_checksum(mirror: Mirror, rpath: str) -> str:
    """xxh3 of an object, read back from the mirror."""
    digest = xxhash.xxh3_64()
    with mirror.fs.open(rpath, "rb", block_size=_READ) as f:
        while chunk := f.read(_READ):
            digest.update(chunk)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def _etag(info: dict) -> str | None:
    etag = info.get("ETag") or info.get("etag")
    return etag.strip('"') if isinstance(etag, str) else None


def _stored_crc32(mirror: Mirror, rpath: str) -> str | None:
    """The CRC32 the S3 server checked on upload and stored, if it keeps one."""
    bucket, key, _ = mirror.fs.split_path(rpath)
    head = mirror.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    return head.get("ChecksumCRC32")


def _remote_matches(mirror: Mirror, rpath: str, info: dict | None, entry: FileEntry, local: _LocalDigest) -> bool:
    """True when the object at ``rpath`` holds exactly the manifest's bytes."""
    if info is None or info.get("size") != entry.size:
        return False
    if local.crc32 is not None:
        stored = _stored_crc32(mirror, rpath)
        if stored is not None:
            return stored == local.crc32
    if local.etag is not None and _etag(info) == local.etag:
        return True
    # No checksum to compare (not S3, a server without flexible checksums, an ETag that is no MD5).
    return remote_checksum(mirror, rpath) == entry.checksum


class _Reporter(Callback):
    """Feeds the client's progress reports to the bandwidth cap and the caller's progress."""

    def __init__(self, throttle: Throttle | None, progress: Progress | None):
        super().__init__()
        self.throttle = throttle
        self.progress = progress
        self.reported = 0

    def relative_update(self, inc: int = 1) -> None:
        self.reported += inc
        if self.progress is not None:
            self.progress(inc)
        if self.throttle is not None:
            self.throttle.consume(inc)


def read_remote_manifest(mirror: Mirror, name: str) -> Manifest | None:
    """The manifest of ``URL/<name>/``; None when there is none or it is invalid (not complete)."""
    try:
        data = mirror.fs.cat_file(mirror.path(name, MANIFEST_NAME))
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_dict(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        return None
    return manifest if step_dir_name(manifest.step) == name else None


def list_mirrored(mirror: Mirror) -> dict[int, Manifest]:
    """Every complete checkpoint in the mirror (a valid manifest recording its own step), by step."""
    try:
        found = mirror.fs.glob(mirror.path(f"global_step_*/{MANIFEST_NAME}"))
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url)) from None
    complete = {}
    for path in found:
        name = path.rstrip("/").split("/")[-2]
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            manifest = read_remote_manifest(mirror, name)
        except Exception as exc:
            raise MirrorError(describe_error(exc, mirror.url)) from None
        if manifest is not None:
            complete[step] = manifest
    return dict(sorted(complete.items()))


def _same_files(a: Manifest, b: Manifest) -> bool:
    return sorted((e.path, e.size, e.checksum) for e in a.files) == sorted((e.path, e.size, e.checksum) for e in b.files)


def _remote_files(mirror: Mirror, remote: str) -> dict[str, dict]:
    """Objects under ``remote`` by path relative to it."""
    try:
        listing = mirror.fs.find(remote, detail=True)
    except FileNotFoundError:
        return {}
    prefix = remote.rstrip("/") + "/"
    return {path[len(prefix):]: info for path, info in listing.items() if path.startswith(prefix)}


def mirror_checkpoint(
    ckpt_dir: Path,
    mirror: Mirror,
    *,
    throttle: Throttle | None = None,
    workers: int = 4,
    progress: Progress | None = None,
) -> MirrorResult:
    """Uploads the committed checkpoint ``ckpt_dir`` to ``mirror`` (see the module's protocol).

    Raises ``MirrorError`` (one line) when the mirror fails, ``CheckpointError`` when the local
    checkpoint is not committed or a file does not match its manifest.
    """
    started = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    name = step_dir_name(manifest.step)
    if ckpt_dir.name != name and parse_step_dir(ckpt_dir.name) is not None:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_NAME}: records step {manifest.step}, not {ckpt_dir.name}")
    remote = mirror.path(name)
    try:
        existing = read_remote_manifest(mirror, name)
        if existing is not None and _same_files(existing, manifest):
            if progress is not None:
                progress(manifest.total_size)
            return MirrorResult(manifest.step, mirror.url_of(name), manifest.total_size, 0, 0, len(manifest.files),
                                time.perf_counter() - started, already_complete=True)
        if existing is not None:
            mirror.fs.rm_file(mirror.path(name, MANIFEST_NAME))  # no longer complete while replaced
        remote_files = _remote_files(mirror, remote)
    except CheckpointError:
        raise
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url)) from None

    uploaded: list[int] = []
    digests: dict[str, _LocalDigest] = {}

    def digest_of(entry: FileEntry) -> _LocalDigest:
        local = ckpt_dir / entry.path
        try:
            digest = local_digest(local, entry.size, for_s3=mirror.is_s3)
        except OSError as exc:
            raise CheckpointError(f"{local}: cannot read ({exc.strerror or exc}); not mirrored") from None
        if digest.checksum != entry.checksum:
            raise CheckpointError(f"{local}: checksum does not match {MANIFEST_NAME}; not mirrored")
        digests[entry.path] = digest
        return digest

    def upload(entry: FileEntry) -> None:
        rpath = mirror.path(name, entry.path)
        if entry.path in remote_files:  # left by an interrupted backup: kept if it is already right
            if _remote_matches(mirror, rpath, remote_files[entry.path], entry, digest_of(entry)):
                if progress is not None:
                    progress(entry.size)
                return
            hashed = None
        else:
            # Hashed while it uploads (the manifest goes up only if every file matched it).
            hashed = hash_pool.submit(digest_of, entry)
        reporter = _Reporter(throttle, progress)
        kwargs = {"chunksize": PART_SIZE} if mirror.is_s3 else {}
        if not mirror.is_s3:  # object stores have no directories; file systems need them
            mirror.fs.makedirs(mirror.fs._parent(rpath), exist_ok=True)
        mirror.fs.put_file(str(ckpt_dir / entry.path), rpath, callback=reporter, **kwargs)
        reporter.relative_update(entry.size - reporter.reported)  # clients that report nothing
        if hashed is not None:
            hashed.result()
        uploaded.append(entry.size)

    def verify(entry: FileEntry, after_upload: dict[str, dict]) -> None:
        rpath = mirror.path(name, entry.path)
        if not _remote_matches(mirror, rpath, after_upload.get(entry.path), entry, digests[entry.path]):
            raise MirrorError(f"{mirror.url_of(name, entry.path)}: verification failed after upload "
                              "(size or checksum differs from the manifest)")

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
                ThreadPoolExecutor(max_workers=max(1, workers)) as hash_pool:
            for future in [pool.submit(upload, entry) for entry in manifest.files]:
                future.result()
            # One listing gives every object's size and ETag (no request per file).
            mirror.fs.invalidate_cache(remote)
            after_upload = _remote_files(mirror, remote)
            for future in [pool.submit(verify, entry, after_upload) for entry in manifest.files]:
                future.result()
        remote_files = after_upload
        listed = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
        for stale in sorted(set(remote_files) - listed):
            mirror.fs.rm_file(mirror.path(name, stale))
        mirror.fs.pipe_file(mirror.path(name, MANIFEST_NAME), (json.dumps(manifest.to_dict(), indent=2) + "\n").encode())
    except CheckpointError:
        raise
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url)) from None
    return MirrorResult(manifest.step, mirror.url_of(name), manifest.total_size, sum(uploaded), len(uploaded),
                        len(manifest.files) - len(uploaded), time.perf_counter() - started)


def delete_mirrored(mirror: Mirror, step: int) -> None:
    """Removes ``URL/global_step_N/``: the manifest first, so an interrupted delete leaves an
    incomplete checkpoint (ignored, and finished by the next delete or backup), never a damaged
    complete-looking one."""
    name = step_dir_name(step)
    try:
        manifest = mirror.path(name, MANIFEST_NAME)
        if mirror.fs.exists(manifest):
            mirror.fs.rm_file(manifest)
        remaining = _remote_files(mirror, mirror.path(name))
        if remaining:
            mirror.fs.rm([mirror.path(name, relative) for relative in sorted(remaining)])
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url)) from None
