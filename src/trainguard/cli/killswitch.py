"""``trainguard killswitch PATH [--clear]``: arms (creates) or clears the kill-switch file of a run.

A run configured with ``lifecycle.kill_switch_path: PATH`` saves and exits 0 before its next step
once PATH exists, and every later start exits 0 at once until the switch is cleared.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import time
from pathlib import Path

from trainguard.fs.fsio import atomic_write_text
from trainguard.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("killswitch", help="arm or clear a run's kill switch file")
    parser.add_argument("path", metavar="PATH", help="the file named by lifecycle.kill_switch_path")
    parser.add_argument("--clear", action="store_true", help="remove the file, so new starts train again")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.is_dir():
        raise ConfigError(f"kill switch {path}: is a directory")
    if args.clear:
        if path.exists():
            path.unlink()
            print(f"kill switch {path} cleared")
        else:
            print(f"kill switch {path} was not armed")
        return 0
    if not path.parent.is_dir():
        raise ConfigError(f"kill switch {path}: directory {path.parent} does not exist")
    who = {"armed_by": _user(), "host": socket.gethostname(), "time": time.time(), "pid": os.getpid()}
    atomic_write_text(path, json.dumps(who) + "\n")
    print(f"kill switch {path} armed: runs using it save and exit 0 before their next step")
    return 0


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
