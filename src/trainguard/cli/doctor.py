"""``trainguard doctor``: the node self-test; exit 0 healthy, 1 unhealthy, with a one-screen report."""

from __future__ import annotations

import argparse
import json

from trainguard.cli.output import stdout_console
from trainguard.doctor.defaults import DEFAULT_REPS, DEFAULT_STORAGE_MB
from trainguard.errors import EXIT_CRASH, EXIT_OK



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("doctor", help="self-test this node: compute burn-in, collectives, storage")
    parser.add_argument("--run-dir", help="record the verdict in RUN_DIR/events.jsonl; check RUN_DIR/checkpoints")
    parser.add_argument("--nproc", type=int, help="local ranks (default: LOCAL_WORLD_SIZE, else one per CUDA device, else 1)")
    parser.add_argument("--dirs", nargs="+", metavar="DIR",
                        help="checkpoint directories to check (default: RUN_DIR/checkpoints, else the current directory)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS, help=f"burn-in repetitions (default {DEFAULT_REPS})")
    parser.add_argument("--size", type=int, help="burn-in matrix size (default 4096 on CUDA, 256 on CPU)")
    parser.add_argument("--storage-mb", type=int, default=DEFAULT_STORAGE_MB,
                        help=f"MiB written per directory (default {DEFAULT_STORAGE_MB})")
    parser.add_argument("--min-write-mb-s", type=float, help="fail a directory slower than this to write")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck local rank fails the test")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trainguard.doctor import self_test

    status_console = Console(stderr=True)
    with status_console.status("trainguard doctor", spinner="dots") as status:
        report = self_test(
            run_dir=args.run_dir, nproc=args.nproc, dirs=args.dirs, reps=args.reps, size=args.size,
            storage_mb=args.storage_mb, min_write_mb_s=args.min_write_mb_s, timeout=args.timeout,
            progress=lambda message: status.update(f"trainguard doctor: {message}"),
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = stdout_console(piped_width=160)
        report.render(console)
    return EXIT_OK if report.healthy else EXIT_CRASH
