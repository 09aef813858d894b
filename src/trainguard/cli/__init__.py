"""The ``trainguard`` command: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys

from trainguard.errors import EXIT_USAGE, TrainguardError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"trainguard: error: {message}\n")


COMMANDS = ("train", "run", "ckpt", "guards", "plan", "demo", "report", "status", "doctor", "killswitch", "watch", "slurm")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; when ``argv`` starts with a command, only that command's module is imported (the
    others would import torch.distributed, transformers, ... before a merge could start)."""
    chosen = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    parser = _Parser(prog="trainguard", description="Keeps training runs alive and checkpoints trustworthy.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in chosen:
        importlib.import_module(f"trainguard.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TrainguardError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
