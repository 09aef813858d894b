"""``trainguard guards calibrate``: data-skip and health thresholds recommended from a clean run."""

from __future__ import annotations

import argparse
import sys

from trainguard.cli.output import stdout_console
from trainguard.guards.calibrate import (
    DEFAULT_MARGIN,
    JSON_FILE,
    PERCENTILES,
    PLOT_FILE,
    SERIES,
    Calibration,
    calibrate_run,
    dumps,
    yaml_snippet,
)



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("guards", help="tools for the numeric guards (data skip, checkpoint health)")
    commands = parser.add_subparsers(dest="guards_command", metavar="{calibrate}", required=True)

    calibrate = commands.add_parser(
        "calibrate",
        help="recommend global-norm spike and embedding-norm thresholds from a clean run's step events",
        description=(
            "Reads RUN_DIR/events.jsonl, prints percentiles of global_norm (and embedding_local_norm) and "
            f"recommended thresholds as YAML, and writes {JSON_FILE} and {PLOT_FILE}."
        ),
    )
    calibrate.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding events.jsonl")
    calibrate.add_argument("--out", metavar="DIR", help=f"where to write {JSON_FILE} and {PLOT_FILE} (default RUN_DIR)")
    calibrate.add_argument("--json", action="store_true", help="print the calibration as JSON instead of tables")
    calibrate.add_argument("--margin", type=float, default=DEFAULT_MARGIN, metavar="M",
                           help=f"head-room factor over the largest clean value (default {DEFAULT_MARGIN})")
    calibrate.add_argument("--ignore-first", type=int, default=0, metavar="N",
                           help="leave steps 1..N (early training) out of the statistics")
    calibrate.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    cal = calibrate_run(args.run_dir, args.out, margin=args.margin, ignore_first=args.ignore_first)
    if args.json:
        print(dumps(cal))
    else:
        _print(cal)
    return 0


def _print(cal: Calibration) -> None:
    # rich is imported when the command prints, not when ``trainguard --help`` builds every parser
    from rich import box
    from rich.syntax import Syntax
    from rich.table import Table

    console = stdout_console()
    title = f"{cal.events}" + (f" (steps after {cal.ignore_first})" if cal.ignore_first else "")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("series", no_wrap=True)
    for header in ("count", "non-finite", *(key for key, _ in PERCENTILES), "max", "max at step"):
        table.add_column(header, justify="right", no_wrap=True)
    for name in SERIES:
        stats = cal.stats.get(name)
        if not stats:
            table.add_row(name, "0", "-", *("-" for _ in PERCENTILES), "-", "-")
            continue
        if not stats["count"]:
            table.add_row(name, "0", str(stats["non_finite"]), *("-" for _ in PERCENTILES), "-", "-")
            continue
        table.add_row(
            name,
            str(stats["count"]),
            str(stats["non_finite"]),
            *(f"{stats[key]:.6g}" for key, _ in PERCENTILES),
            f"{stats['max']:.6g}",
            str(stats["max_step"]),
        )
    console.print(table)
    console.print(
        f"longest streak above p99: {cal.longest_elevated_streak} step(s); margin: {cal.margin!r}",
        markup=False, highlight=False,
    )
    console.print("recommended (reference keys; trainguard reads them as aliases):", markup=False, highlight=False)
    if console.is_terminal:
        console.print(Syntax(yaml_snippet(cal), "yaml", background_color="default"))
    else:
        console.print(yaml_snippet(cal), markup=False, highlight=False, end="")
    for note in cal.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    wrote = f"{JSON_FILE} and {PLOT_FILE}" if cal.plot else JSON_FILE
    print(f"wrote {wrote} to {cal.out_dir}", file=sys.stderr)
