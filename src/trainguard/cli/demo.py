"""``trainguard demo``: the fault drill on the reference trainer."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run a fault drill on the reference trainer")
    parser.add_argument("--out", help="directory for the drill's runs (default runs/demo-<timestamp>)")
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--live", action="store_true",
                        help="the live-recovery drill: a rank dies mid-run, the job never restarts (docs/live_recovery.md)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.live:
        from trainguard.demo.live import run_live_drill

        return run_live_drill(out.resolve())
    from trainguard.demo.drill import run_drill

    return run_drill(out.resolve(), quick=args.quick)
