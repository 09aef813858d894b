"""The commands people run by hand and from cron answer without importing torch or transformers.

Each command runs through the installed ``trainguard`` entry point in a subprocess with
``PYTHONPROFILEIMPORTTIME=1``: Python itself then lists on stderr every module the command imported,
from start to exit, so a heavy import anywhere on the command's path (its parser, its run function,
what they call) fails the test naming the command. ``--help`` is checked for the top level and every
command and sub-command the parser has; ``status``, ``watch``, ``killswitch`` and ``ckpt list|verify``
run on the real 2-rank run of the ``committed_run`` fixture.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.cli import build_parser

from helpers.runs import worker_env

ENTRY_POINT = Path(sys.executable).with_name("trainguard")
HEAVY = ("torch", "transformers")
PRINTING = ("rich",)  # a command imports it when it prints; a parser never needs it


def imported_modules(*args: str, expect_code: int = 0) -> set[str]:
    """Every module ``trainguard ARGS`` imported; fails unless it exited ``expect_code``."""
    assert ENTRY_POINT.is_file(), f"no trainguard entry point beside {sys.executable}: pip install -e ."
    env = worker_env(PYTHONPROFILEIMPORTTIME="1", COLUMNS="120")
    done = subprocess.run([str(ENTRY_POINT), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == expect_code, f"trainguard {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}"
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


def assert_light(*args: str, expect_code: int = 0, heavy_packages: tuple[str, ...] = HEAVY) -> None:
    modules = imported_modules(*args, expect_code=expect_code)
    assert "trainguard.cli" in modules, "the import trace is missing: PYTHONPROFILEIMPORTTIME had no effect"
    heavy = sorted(name for name in modules if name.split(".")[0] in heavy_packages)
    assert not heavy, f"trainguard {' '.join(args)} imported {heavy[:5]}"


def help_commands() -> list[tuple[str, ...]]:
    """``()`` and every command and sub-command path of the parser, e.g. ``("ckpt", "list")``."""
    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += walk(sub, path + (name,))
        return found

    return walk(build_parser(), ())


@pytest.mark.parametrize("command", help_commands(), ids=lambda command: " ".join(command) or "trainguard")
def test_help_imports_neither_torch_nor_transformers_nor_rich(command):
    assert_light(*command, "--help", heavy_packages=HEAVY + PRINTING)


def test_status_watch_killswitch_and_ckpt_list_on_a_real_run_import_neither(committed_run, tmp_path):
    assert_light("status", str(committed_run))
    assert_light("watch", str(committed_run), "--once")  # every rank exited 0: "finished"
    quiet = tmp_path / "quiet-run"
    quiet.mkdir()
    assert_light("watch", str(quiet), "--once", expect_code=1)  # no heartbeat and no job: the alert path
    switch = tmp_path / "stop"
    assert_light("killswitch", str(switch))
    assert switch.is_file()
    assert_light("killswitch", str(switch), "--clear")
    assert not switch.exists()
    for directory in (committed_run, committed_run / "checkpoints", committed_run / "checkpoints" / "global_step_8"):
        assert_light("ckpt", "list", str(directory))
    assert_light("ckpt", "list", str(committed_run), "--json")
    assert_light("ckpt", "verify", str(committed_run))

