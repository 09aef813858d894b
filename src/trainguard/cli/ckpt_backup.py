"""``trainguard ckpt backup|restore``: copy committed checkpoints to a mirror (any fsspec URL) and back."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.checkpoint.discovery import list_checkpoints, newest_committed
from trainguard.fs.layout import TRASH_PREFIX, step_dir_name
from trainguard.cli.arguments import resolve_root
from trainguard.cli.output import byte_progress, warn
from trainguard.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from trainguard.backup.mirror import MirrorResult
    from trainguard.backup.throttle import Throttle
    from trainguard.backup.url import Mirror


def add_commands(commands: argparse._SubParsersAction) -> None:
    backup = commands.add_parser("backup", help="upload committed checkpoints to a mirror URL (s3://, file://, ...)")
    backup.add_argument("dir", metavar="DIR", help="run directory or its checkpoints/ directory")
    backup.add_argument("url", metavar="URL", help="mirror root, such as s3://bucket/run-a")
    backup.add_argument("--step", type=int, metavar="N", help="back up only global_step_N (default: every committed one)")
    backup.add_argument("--weights-only", action="store_true",
                        help="upload the model weights only (model.safetensors + huggingface/), not the optimizer")
    backup.add_argument("--bandwidth-mbps", type=float, metavar="MB_PER_S", help="upload cap in megabytes per second")
    backup.add_argument("--workers", type=int, default=4, help="files uploaded at once (default 4)")
    backup.add_argument("--endpoint-url", help="S3-compatible endpoint (default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    backup.set_defaults(func=run_backup)

    restore = commands.add_parser("restore", help="download a mirrored checkpoint into a run directory")
    restore.add_argument("url", metavar="URL", help="mirror root, such as s3://bucket/run-a")
    restore.add_argument("dir", metavar="DIR", help="run directory (restored into DIR/checkpoints) or checkpoints root")
    restore.add_argument("--step", type=int, metavar="N", help="restore global_step_N (default: the newest healthy one)")
    restore.add_argument("--endpoint-url", help="S3-compatible endpoint (default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    restore.set_defaults(func=run_restore)


def run_backup(args: argparse.Namespace) -> int:
    # the backup package is imported when a command runs: fsspec would slow every ``ckpt`` command's start
    from trainguard.backup.throttle import throttle_from_mbps
    from trainguard.backup.url import MirrorError, check_reachable, open_mirror

    if args.bandwidth_mbps is not None and args.bandwidth_mbps <= 0:
        raise ConfigError(f"--bandwidth-mbps must be > 0, got {args.bandwidth_mbps}")
    if args.workers < 1:
        raise ConfigError(f"--workers must be ≥ 1, got {args.workers}")
    root = resolve_root(args.dir)
    checkpoints = [info for info in list_checkpoints(root) if not info.being_written]
    if args.step is not None:
        checkpoints = [info for info in checkpoints if info.step == args.step]
        if not checkpoints:
            raise ConfigError(f"no checkpoint {step_dir_name(args.step)} in {root}")
    mirror = open_mirror(args.url, args.endpoint_url)
    check_reachable(mirror)
    throttle = throttle_from_mbps(args.bandwidth_mbps)
    failed = 0
    for info in checkpoints:
        if not info.committed:
            if args.step is None:
                warn(f"skipping {info.path}: {info.error}")
                continue
            raise CheckpointError(f"{info.path}: {info.error}; not backed up")
        try:
            result = _backup_one(info.path, root, mirror, throttle, args)
        except MirrorError:
            raise  # the mirror itself failed: the next checkpoint would fail the same way
        except CheckpointError as exc:  # this local checkpoint is damaged: back up the others
            print(f"trainguard: error: {exc}", file=sys.stderr)
            failed += 1
            continue
        if result.already_complete:
            print(f"{info.name}: already in the mirror ({result.url})")
        else:
            print(f"{info.name}: mirrored to {result.url} ({result.bytes_uploaded / 1e6:.1f} MB uploaded, "
                  f"{result.files_reused} file(s) already there, {result.seconds:.1f}s, verified)")
    return 1 if failed else 0


def _backup_one(path: Path, root: Path, mirror: Mirror, throttle: Throttle, args: argparse.Namespace) -> MirrorResult:
    from trainguard.checkpoint.trusted import require_regular_entries, require_verified

    if not args.weights_only:
        require_regular_entries(path)  # the upload checks every checksum as it reads
        return _upload(path, mirror, throttle, args.workers)
    require_verified(path)  # the export writes a fresh manifest: never over unverified bytes
    staging = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}weights-", dir=root))
    try:
        from trainguard.backup.weights_only import export_weights_only

        export_weights_only(path, staging / path.name)
        return _upload(staging / path.name, mirror, throttle, args.workers)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _upload(path: Path, mirror: Mirror, throttle: Throttle, workers: int) -> MirrorResult:
    from trainguard.backup.mirror import mirror_checkpoint
    from trainguard.checkpoint.manifest import read_manifest

    total = read_manifest(path).total_size
    with byte_progress(f"uploading {path.name}", total) as advance:
        return mirror_checkpoint(path, mirror, throttle=throttle, workers=workers, progress=advance)


def run_restore(args: argparse.Namespace) -> int:
    from trainguard.backup.mirror import list_mirrored
    from trainguard.backup.restore import choose_mirrored, is_weights_only, restore_checkpoint
    from trainguard.backup.url import check_reachable, open_mirror

    directory = Path(args.dir)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory}: exists and is not a directory")
    has_steps = newest_committed(directory) is not None
    root = directory if directory.name == "checkpoints" or has_steps else directory / "checkpoints"
    mirror = open_mirror(args.url, args.endpoint_url)
    check_reachable(mirror)
    manifest = choose_mirrored(list_mirrored(mirror), args.step, mirror.url)
    with byte_progress(f"downloading {step_dir_name(manifest.step)}", manifest.total_size) as advance:
        path = restore_checkpoint(mirror, manifest, root, progress=advance)
    note = " (weights only: loadable, not resumable)" if is_weights_only(manifest) else ""
    print(f"restored {mirror.url_of(step_dir_name(manifest.step))} into {path}, verified{note}")
    return 0
