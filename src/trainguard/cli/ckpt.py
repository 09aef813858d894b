"""``trainguard ckpt list|verify``: what checkpoints a run has, and whether their files are intact."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.checkpoint.discovery import CheckpointInfo, latest_fault, list_checkpoints
from trainguard.cli.arguments import resolve_root
from trainguard.cli.output import byte_progress, stdout_console, warn
from trainguard.fs.layout import HEALTH_FILE, LATEST_FILE, step_dir_name
from trainguard.checkpoint.manifest import BadFile, verify_checkpoint
from trainguard.checkpoint.role_dirs import checkpoint_dir, frozen_role_dirs
from trainguard.errors import ConfigError
from trainguard.fs.bounded import parse_json, read_regular_text
from trainguard.guards.health import MAX_HEALTH_FILE_BYTES, Health, health_of

EXIT_BAD_CHECKPOINT = 1
_DIR_HELP = "run directory, its checkpoints/ directory, or one checkpoint (global_step_N, global_step_N/ROLE)"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ckpt", help="list, verify, repair, back up, merge and convert checkpoints")
    metavar = "{list,verify,repair,backup,restore,merge,test,convert}"
    commands = parser.add_subparsers(dest="ckpt_command", metavar=metavar, required=True)

    listing = commands.add_parser("list", help="one line per checkpoint: committed, verified, size, health")
    listing.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    listing.add_argument("--json", action="store_true", help="print the facts as a JSON list")
    listing.add_argument("--no-verify", action="store_true", help="skip reading and checksumming the files")
    listing.set_defaults(func=run_list)

    verify = commands.add_parser("verify", help="check every file of every committed checkpoint")
    verify.add_argument("dir", metavar="DIR", help=_DIR_HELP)
    verify.add_argument("--step", type=int, metavar="N", help="verify only global_step_N")
    verify.set_defaults(func=run_verify)

    # imported here: these modules use this one's helpers (progress bars, root resolution)
    from trainguard.cli import ckpt_backup, ckpt_convert, ckpt_merge, ckpt_repair

    for module in (ckpt_repair, ckpt_backup, ckpt_merge, ckpt_convert):
        module.add_commands(commands)


def run_list(args: argparse.Namespace) -> int:
    root, infos = _checkpoints(args.dir)
    health_records = _read_health_records(root)
    facts = []
    for info in infos:
        bad = _verify(info) if info.committed and not args.no_verify else None
        facts.append(_facts(info, bad, health_records))
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        _print_table(root, facts)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    root, infos = _checkpoints(args.dir)
    checkpoints = [info for info in infos if not info.being_written]
    if args.step is not None:
        checkpoints = [info for info in checkpoints if info.step == args.step]
        if not checkpoints:
            raise ConfigError(f"no checkpoint {step_dir_name(args.step)} in {root}")
    if not checkpoints:
        print(f"no checkpoints in {root}", file=sys.stderr)
        return 0
    all_good = True
    for info in checkpoints:
        if not info.committed:
            # For a committed-looking directory the error names the manifest file and its fault.
            print(f"BAD {info.name}/{info.error}")
            all_good = False
            continue
        bad = _verify(info)
        for fault in bad:
            print(f"BAD {info.name}/{fault.path}: {fault.reason}")
        if not bad:
            print(f"OK {info.name}")
        all_good = all_good and not bad
    if root.is_dir() and checkpoint_dir(Path(args.dir)) is None and args.step is None:
        fault = latest_fault(root, {info.step for info in infos if info.committed})
        if fault is not None:
            print(f"BAD {LATEST_FILE}: {fault.removeprefix(str(root / LATEST_FILE) + ': ')}")
            all_good = False
    return 0 if all_good else EXIT_BAD_CHECKPOINT


def _checkpoints(directory: str) -> tuple[Path, list[CheckpointInfo]]:
    """The checkpoints DIR names: itself when it is one checkpoint, else every one under its root (with
    the frozen roles of a multi-role run, which no step's manifest covers)."""
    single = checkpoint_dir(Path(directory))
    if single is not None:
        return single.path, [single]
    root = resolve_root(directory)
    return root, list_checkpoints(root) + frozen_role_dirs(root)


def _verify(info: CheckpointInfo) -> list[BadFile]:
    assert info.manifest is not None
    with byte_progress(f"verifying {info.name}", info.manifest.total_size) as advance:
        return verify_checkpoint(info.path, info.manifest, progress=advance)


def _read_health_records(root: Path) -> dict[str, dict]:
    """``ckpt_name -> record`` from ``health_ckpts.json``; the last record wins."""
    path = root / HEALTH_FILE
    try:
        records = parse_json(read_regular_text(path, MAX_HEALTH_FILE_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warn(f"{path}: unreadable ({exc}); health shown from manifests only")
        return {}
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and isinstance(r.get("ckpt_name"), str) and isinstance(r.get("is_health"), int)
        for r in records
    ):
        warn(f'{path}: expected [{{"is_health": 0|1, "ckpt_name": ...}}, ...]; health shown from manifests only')
        return {}
    return {record["ckpt_name"]: record for record in records}


def _health(info: CheckpointInfo, health_records: dict[str, dict]) -> str | None:
    verdict = health_of(info.manifest.health) if info.manifest is not None else None
    if verdict is None:
        verdict = health_of(health_records.get(info.name))
    if verdict is None:
        return None
    return "unhealthy" if verdict is Health.UNHEALTHY else "healthy"


def _facts(info: CheckpointInfo, bad: list[BadFile] | None, health_records: dict[str, int]) -> dict[str, Any]:
    manifest = info.manifest
    created = manifest.created if manifest else None
    return {
        "step": info.step,
        "name": info.name,
        "path": str(info.path),
        "committed": info.committed,
        "verified": None if bad is None else not bad,
        "bad_files": [{"path": fault.path, "reason": fault.reason} for fault in bad or []],
        "size_bytes": manifest.total_size if manifest else None,
        "world_size": manifest.world_size if manifest else None,
        "created": created,
        "created_local": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created is not None else None,
        "health": _health(info, health_records),
        "error": info.error,
        "roles": manifest.extra.get("roles") if manifest else None,
        "role": manifest.extra.get("role") if manifest else None,
    }


def _print_table(root: Path, facts: list[dict[str, Any]]) -> None:
    # rich is imported when the command prints, not when ``trainguard --help`` builds every parser
    from rich import box
    from rich.filesize import decimal
    from rich.table import Table

    console = stdout_console()
    if not facts:
        console.print(f"no checkpoints in {root}")
        return
    table = Table(title=str(root), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in ("step", "committed", "verified", "size", "world size", "created", "health"):
        table.add_column(header, justify="right" if header in ("step", "size", "world size") else "left", no_wrap=True)
    notes = []
    for row in facts:
        table.add_row(
            f"{row['role']} ({row['step']})" if row["role"] else str(row["step"]),
            "yes" if row["committed"] else "no",
            _yes_no_dash(row["verified"]),
            decimal(row["size_bytes"]) if row["size_bytes"] is not None else "-",
            _dash(row["world_size"]),
            _dash(row["created_local"]),
            _dash(row["health"]),
        )
        # Below the table, not in it, so that a file name is never cut off to fit the terminal.
        faults = [row["error"]] if row["error"] else [f"{f['path']}: {f['reason']}" for f in row["bad_files"]]
        notes += [f"{row['name']}: {fault}" for fault in faults]
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)


def _yes_no_dash(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)
