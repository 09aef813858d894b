"""The ``trainguard`` command: one module per subcommand, each with ``add_parser`` and ``run``.

A module of this package imports at its top only what its parser needs (no torch, transformers, rich,
fsspec, numpy); what a command needs to run is imported in its run function. So ``--help``, every
parser and the everyday commands (``status``, ``watch``, ``killswitch``, ``ckpt list``) answer in a
fraction of a second (``tests/integration/test_cli_light.py``, ``benchmarks/cli_start.py``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trainguard.errors import EXIT_CLOSED_STDOUT, EXIT_USAGE, TrainguardError
from trainguard.forking import import_numpy_with_one_thread


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"trainguard: error: {message}\n")


COMMANDS = ("train", "run", "ckpt", "guards", "plan", "demo", "report", "status", "doctor", "killswitch", "watch", "slurm")
# the commands whose process forks its helpers (the live launcher, node agents, fork servers): one thread first
FORKING_COMMANDS = ("train", "run", "demo")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; when ``argv`` starts with a command, only that command's module is imported."""
    chosen = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    parser = _Parser(prog="trainguard", description="Keeps training runs alive and checkpoints trustworthy.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in chosen:
        importlib.import_module(f"trainguard.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in FORKING_COMMANDS:  # before its parser's imports (torch, for the configuration)
        import_numpy_with_one_thread()
    args = build_parser(argv).parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is answered below, not in the interpreter's exit
        return code
    except TrainguardError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (``trainguard plan --json | head -1``): nothing more to say
        return closed_stdout()


def closed_stdout() -> int:
    """Points stdout at /dev/null so the interpreter's final flush of what is still buffered does not
    raise again (Python's own advice for SIGPIPE), and gives the shell's code for a closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_STDOUT
