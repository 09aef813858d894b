"""The ``trainguard`` command: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import sys

from trainguard.errors import EXIT_USAGE, TrainguardError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"trainguard: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from trainguard.cli import ckpt, demo, doctor, guards, killswitch, plan, report, run, slurm, status, train, watch

    parser = _Parser(prog="trainguard", description="Keeps training runs alive and checkpoints trustworthy.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (train, run, ckpt, guards, plan, demo, report, status, doctor, killswitch, watch, slurm):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TrainguardError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
