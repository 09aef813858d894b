"""``trainguard report RUN_DIR``: the run as one self-contained HTML page (and TensorBoard scalars)."""

from __future__ import annotations

import argparse

from trainguard.report import REPORT_FILE


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help=f"write RUN_DIR/{REPORT_FILE}: curves, skips, SDC detections, checkpoints, restarts, recovery",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (--run-dir of trainguard train)")
    parser.add_argument("--out", metavar="FILE", help=f"write the page here instead of RUN_DIR/{REPORT_FILE}")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="do not write TensorBoard scalars to RUN_DIR/tensorboard/ (written when tensorboard is installed)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs, not when ``trainguard --help`` builds every parser
    from rich.console import Console

    from trainguard.report import write_report
    from trainguard.report.tensorboard import write_scalars

    console = Console(stderr=True)
    with console.status("reading the run and drawing the plots", spinner="dots"):
        path, facts = write_report(args.run_dir, args.out)
        scalars = None if args.no_tensorboard else write_scalars(facts)
    print(f"report: {path}")
    if scalars is not None:
        print(f"tensorboard scalars: {scalars}")
    elif not args.no_tensorboard:
        print("tensorboard scalars: not written (tensorboard is not installed)")
    for note in facts.notes:
        print(f"note: {note}")
    return 0
