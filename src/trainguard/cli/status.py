"""``trainguard status RUN_DIR``: one screen on a live or finished run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from trainguard.cli.output import stdout_console

if TYPE_CHECKING:
    from rich.table import Table

    from trainguard.report.facts import RunFacts


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="one screen on a live or finished run")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (--run-dir of trainguard train)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs, not when ``trainguard --help`` builds every parser

    from trainguard.report.facts import read_run

    facts = read_run(args.run_dir)
    console = stdout_console(piped_width=160)
    console.print(status_table(facts))
    for note in facts.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    return 0


def status_table(facts: RunFacts) -> Table:
    from rich import box
    from rich.table import Table

    from trainguard.report.summary import status_rows

    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, value in status_rows(facts):
        table.add_row(label, value)
    return table
