"""Restoring a mirrored checkpoint into a local checkpoints root, committed the same way a save is.

Files are downloaded into ``global_step_N.tmp-<token>/``, each checked against the mirrored manifest
(xxh3); once all of them are there the directory is committed like a save (``checkpoint.commit``:
fsynced, manifest last, renamed to ``global_step_N``, ``health_ckpts.json`` updated), except that
``latest_checkpointed_iteration.txt`` only moves forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from fsspec.callbacks import Callback

from trainguard.backup.mirror import list_mirrored
from trainguard.backup.url import Mirror, MirrorError, describe_error, open_mirror
from trainguard.checkpoint.checksum import file_checksum
from trainguard.checkpoint.commit import Latest, commit_checkpoint
from trainguard.checkpoint.manifest import Manifest, read_manifest, verify_checkpoint
from trainguard.errors import CheckpointError, NoCheckpointError
from trainguard.fs.fsio import remove_directory_crash_safe
from trainguard.fs.layout import MANIFEST_NAME, parse_step_dir, step_dir_name, temp_dir_name
from trainguard.guards.health import marked_unhealthy

log = logging.getLogger("trainguard")
Progress = Callable[[int], None]


def is_weights_only(manifest: Manifest) -> bool:
    return bool(manifest.extra.get("weights_only"))


def choose_mirrored(mirrored: dict[int, Manifest], step: int | None, url: str, *, for_resume: bool = False) -> Manifest:
    """The mirrored checkpoint to restore: ``step``, or the newest healthy one (full ones only when
    resuming); ``NoCheckpointError`` (exit 4) when there is none."""
    if step is not None:
        if step not in mirrored:
            have = ", ".join(str(s) for s in mirrored) or "none"
            raise NoCheckpointError(f"{url}: no complete {step_dir_name(step)} in the mirror (complete steps: {have})")
        return mirrored[step]
    candidates = [m for m in mirrored.values() if not marked_unhealthy(m.health)
                  and not (for_resume and is_weights_only(m))]
    if not candidates:
        raise NoCheckpointError(f"{url}: no complete healthy checkpoint in the mirror")
    return candidates[-1]


class _Advance(Callback):
    def __init__(self, progress: Progress | None):
        super().__init__()
        self.progress = progress

    def relative_update(self, inc: int = 1) -> None:
        if self.progress is not None:
            self.progress(inc)


def restore_checkpoint(mirror: Mirror, manifest: Manifest, root: Path, *, progress: Progress | None = None) -> Path:
    """Downloads the mirrored checkpoint ``manifest`` describes into ``root/global_step_N`` and returns
    that path. A local copy that verifies is kept as it is; one that does not is replaced."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(manifest.step)
    final = root / name
    if final.is_dir():
        try:
            if not verify_checkpoint(final, read_manifest(final)):
                if progress is not None:
                    progress(manifest.total_size)
                return final
        except CheckpointError:
            pass
        log.warning("replacing local %s, which does not verify, with the mirrored copy", final)
    check_mirrored_entries(mirror, name, manifest)
    tmp = root / temp_dir_name(manifest.step)
    try:
        for entry in manifest.files:
            local = tmp / entry.path
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                mirror.fs.get_file(mirror.path(name, entry.path), str(local), callback=_Advance(progress))
            except Exception as exc:
                raise MirrorError(describe_error(exc, mirror.url_of(name, entry.path))) from None
            if local.stat().st_size != entry.size or file_checksum(local) != entry.checksum:
                raise MirrorError(f"{mirror.url_of(name, entry.path)}: downloaded bytes do not match {MANIFEST_NAME} "
                                  "(the mirrored copy is damaged)")
        final = commit_checkpoint(tmp, manifest, replace=True, latest=Latest.IF_NEWER).path
    except BaseException:
        if tmp.exists():
            remove_directory_crash_safe(tmp)
        raise
    return final


def check_mirrored_entries(mirror: Mirror, name: str, manifest: Manifest) -> None:
    """Refuses a mirrored checkpoint holding anything but its listed regular files and its manifest: a
    symlink (a ``file://`` mirror would be read through it, from outside the checkpoint), a FIFO or device
    (a read would block or never end), or an entry the manifest does not list (one line naming it)."""
    listed = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
    prefix = mirror.path(name).rstrip("/") + "/"
    try:
        found = mirror.fs.find(mirror.path(name), detail=True)
    except Exception as exc:
        raise MirrorError(describe_error(exc, mirror.url_of(name))) from None
    for path, info in sorted(found.items()):
        relative = path[len(prefix):] if path.startswith(prefix) else path
        if info.get("islink"):
            problem = "a symlink"
        elif info.get("type") != "file":
            problem = f"not a regular file ({info.get('type')})"
        elif relative not in listed:
            problem = f"not listed in {MANIFEST_NAME}"
        else:
            continue
        raise MirrorError(f"{mirror.url_of(name, relative)}: {problem}; refusing to restore this checkpoint")


def split_step_url(url: str) -> tuple[str, int | None]:
    """``s3://b/p/global_step_8`` → (``s3://b/p``, 8); any other URL → (url, None)."""
    head, _, last = url.rstrip("/").rpartition("/")
    step = parse_step_dir(last)
    return (head, step) if step is not None and "://" in head else (url.rstrip("/"), None)


def restore_for_resume(url: str, root: Path, endpoint_url: str | None = None) -> str:
    """What ``--resume URL`` means: the mirror's newest healthy full checkpoint (or the one the URL
    names, ``.../global_step_N``) is restored into ``root`` unless a local copy verifies, and the
    resume mode to use is returned: ``auto`` (a newer local checkpoint, committed after the mirrored
    one, still wins), or the restored path when the URL names a step."""
    base, step = split_step_url(url)
    mirror = open_mirror(base, endpoint_url)
    mirrored = list_mirrored(mirror)
    if step is None and not any(not marked_unhealthy(m.health) and not is_weights_only(m) for m in mirrored.values()):
        log.warning("%s: no complete healthy checkpoint in the mirror; resuming from local checkpoints, if any",
                    mirror.url)
        return "auto"
    manifest = choose_mirrored(mirrored, step, mirror.url, for_resume=True)
    if is_weights_only(manifest):
        raise NoCheckpointError(f"{mirror.url_of(step_dir_name(manifest.step))}: a weights-only backup "
                                "cannot resume training (no optimizer state)")
    log.info("restoring %s from the mirror into %s", mirror.url_of(step_dir_name(manifest.step)), root)
    path = restore_checkpoint(mirror, manifest, root)
    return str(path) if step is not None else "auto"
