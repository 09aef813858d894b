"""The one commit of a checkpoint directory, used by every writer (the durable tier, the role manager,
the Hugging Face converter, a restore from the mirror).

A checkpoint is written into a directory that is not one yet (``global_step_N.tmp-<token>/``). The
commit then, in this order:

1. ``seal``: writes the manifest ``trainguard.json``, then fsyncs it, each listed file its writer did
   not fsync (files hashed by reading them, such as DCP's ``.metadata`` or the static files) and every
   directory of the tree, all at once (``fsio.fsync_all``: issued together, they share the file
   system's journal commits instead of waiting for one each): from here on the directory describes
   itself;
2. ``publish``: renames it to its final name (deleting a directory of that name first only when told
   to, crash-safely);
3. records its health in ``health_ckpts.json`` when the manifest carries a verdict;
4. replaces ``latest_checkpointed_iteration.txt``;
5. fsyncs the parent once, so that the rename, the health record and the tracker survive a power loss
   (one directory fsync instead of three: each costs a journal commit, 8-10 ms on this machine's disk).

A crash before step 2 leaves a ``.tmp-`` directory, which is never a checkpoint; after it, the
checkpoint is complete and discovery finds it whatever ``latest`` says.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from trainguard.checkpoint.discovery import read_latest, write_latest
from trainguard.checkpoint.manifest import Manifest, write_manifest
from trainguard.fs.fsio import commit_directory, fsync_all, fsync_dir, tree_directories
from trainguard.fs.layout import HEALTH_FILE, MANIFEST_NAME, step_dir_name
from trainguard.guards.health import marked_unhealthy, record_health


class Latest(enum.Enum):
    """What a commit does to ``latest_checkpointed_iteration.txt``."""

    SET = "set"  # a save: the new checkpoint is the one of record
    IF_NEWER = "if_newer"  # a restore of an older step must not move the pointer back


@dataclass(frozen=True)
class Committed:
    path: Path
    manifest: Manifest
    replaced: bool
    """A committed directory of the same name was there and was replaced (a redone step)."""


def seal(directory: Path, manifest: Manifest, *, fsynced: Collection[str] = ()) -> None:
    """Makes ``directory``'s files, its manifest and its entries durable: one fsync of each, all issued
    together once the manifest is in place (the directory is not published yet, so no file need be
    durable before another, only all of them before the publishing rename).

    ``fsynced``: relative paths of files their writers already fsynced (hashed as written); every other
    file the manifest lists is fsynced here: having been read to hash it says nothing about its being
    on disk.
    """
    directory = Path(directory)
    write_manifest(directory, manifest, sync_dir=False, sync_file=False)
    unsynced = [directory / entry.path for entry in manifest.files if entry.path not in fsynced]
    fsync_all([*unsynced, directory / MANIFEST_NAME, *tree_directories(directory)])


def commit_checkpoint(
    staged: Path,
    manifest: Manifest,
    *,
    fsynced: Collection[str] = (),
    replace: bool = False,
    latest: Latest = Latest.SET,
) -> Committed:
    """Seals ``staged`` and publishes it as ``global_step_<manifest.step>`` beside it; records its
    health and updates ``latest``. With ``replace``, a committed directory of that step is replaced
    (a redone step, or a restore over a copy that does not verify); otherwise it is an error."""
    staged = Path(staged)
    root = staged.parent
    final = root / step_dir_name(manifest.step)
    seal(staged, manifest, fsynced=fsynced)
    # the rename, the health record and the tracker share one fsync of ``root``: a crash before it may
    # keep any of them, and each alone is safe (the manifest is the checkpoint's own health record, and
    # a tracker naming no committed checkpoint is repaired at resume: ``discovery.latest_fault``)
    replaced = commit_directory(staged, final, replace=replace, sync_parent=False)
    if manifest.health is not None:
        record_health(root / HEALTH_FILE, final.name, marked_unhealthy(manifest.health), sync_dir=False)
    if latest is Latest.SET or (read_latest(root) or 0) <= manifest.step:
        write_latest(root, manifest.step, sync_dir=False)
    fsync_dir(root)
    return Committed(final, manifest, replaced)
