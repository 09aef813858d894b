"""``trainguard ckpt repair DIR [--step N]``: restores missing or corrupt local-tier files from replicas."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trainguard.fs.layout import step_dir_name
from trainguard.cli.output import byte_progress
from trainguard.errors import ConfigError
from trainguard.events import EventLog

EXIT_LOST = 1


def add_commands(commands: argparse._SubParsersAction) -> None:
    repair = commands.add_parser("repair", help="restore missing or corrupt local checkpoint files from replicas")
    repair.add_argument("dir", metavar="DIR", help="run directory, its local/ directory or one node's local directory")
    repair.add_argument("--step", type=int, metavar="N", help="repair only global_step_N")
    repair.set_defaults(func=run_repair)


def _events_file(directories: list[Path]) -> Path | None:
    for directory in directories:
        for parent in list(directory.parents)[:4]:
            if (parent / "events.jsonl").is_file():
                return parent / "events.jsonl"
    return None


def run_repair(args: argparse.Namespace) -> int:
    # here, not at the top: every ``trainguard ckpt`` command builds this parser, and these import torch, rich
    from rich.filesize import decimal

    from trainguard.checkpoint.local.repair import discover, local_steps, newest_durable, repair_rate, repair_step

    local = discover(args.dir)
    steps = local_steps(local)
    if args.step is not None:
        if args.step not in steps:
            raise ConfigError(f"no local checkpoint {step_dir_name(args.step)} under {args.dir}")
        steps = [args.step]
    if not steps:
        print(f"no local checkpoints under {args.dir}")
        return 0
    events_path = _events_file(sorted(set(local.rank_dirs.values())))
    events = EventLog(events_path) if events_path else None
    results, lost = [], []
    started = time.perf_counter()
    for step in steps:
        with byte_progress(f"repairing {step_dir_name(step)}", None) as advance:
            result = repair_step(local, step, progress=advance)
        results.append(result)
        name = step_dir_name(step)
        for action in result.actions:
            t = action.transfer
            print(f"REPAIRED {name}/{t.dst_path} (rank {t.dst}) from rank {t.src}: {action.src_file} -> "
                  f"{action.dst_file} ({decimal(t.entry.size)}, verified)")
        if not result.plan.recoverable:
            lost.append(result)
            continue
        print(f"OK {name}" + (" (re-verified after repair)" if result.actions else ""))
        if result.actions and events is not None:
            step_seconds = time.perf_counter() - started
            events.emit("local_repaired", step=step, bytes=sum(a.transfer.entry.size for a in result.actions),
                        files=len(result.actions), seconds=step_seconds, offline=True)
    files, moved, rate = repair_rate(results, time.perf_counter() - started)
    if files:
        print(f"repaired {files} files, {decimal(moved)} in {time.perf_counter() - started:.2f}s ({decimal(int(rate))}/s)")
    if lost:
        durable = newest_durable(local)
        where = f"resume from the newest durable checkpoint: {durable}" if durable else \
            "no durable checkpoint was found next to these directories"
        for result in lost:
            detail = ", ".join(f"rank {rank} {kind}" for rank, kind in result.plan.lost)
            print(f"LOST {step_dir_name(result.step)}: ranks {result.plan.lost_ranks} cannot be restored: every "
                  f"member of their replica group lost its copy ({detail}); {where}")
        return EXIT_LOST
    return 0
