"""``trainguard demo``: the fault drill on the reference trainer."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run a fault drill on the reference trainer")
    parser.add_argument("--out", help="directory for the drill's runs (default runs/demo-<timestamp>)")
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainguard.demo.drill import run_drill

    out = Path(args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    return run_drill(out.resolve(), quick=args.quick)
