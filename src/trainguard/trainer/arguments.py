"""The trainer's flags (``--config``, ``--steps``, ``--set`` ...) and their translation into ``--set`` items.

Kept apart from ``entry`` (which imports torch) so that ``trainguard train --help`` and the parser of
every other command are built without importing torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    parser.add_argument("--run-dir", help="directory holding checkpoints, events and logs of the run")
    parser.add_argument("--save-interval", type=int, help="steps between durable checkpoints (checkpoint.save_interval)")
    parser.add_argument("--resume", help="auto (newest verified checkpoint), disable, a checkpoint PATH, "
                        "or a mirror URL (restored into the run directory first)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key; repeatable")


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The flags as ``--set`` items, so workers started anywhere see the same configuration."""
    items = list(args.overrides)
    if args.steps is not None:
        items.append(f"train.steps={args.steps}")
    if args.save_interval is not None:
        items.append(f"checkpoint.save_interval={args.save_interval}")
    if args.resume is not None:
        items.append(resume_item(args.resume))
    return items


def resume_item(mode: str) -> str:
    """``--resume MODE`` as a ``--set`` item: a checkpoint PATH made absolute (``auto``, ``disable`` and a
    mirror URL as given)."""
    keep = mode in ("auto", "disable") or "://" in mode
    return f"checkpoint.resume={mode if keep else Path(mode).resolve()}"


def config_arguments(args: argparse.Namespace) -> list[str]:
    """The flags that give a rank started elsewhere the same configuration: the file (absolute) and the
    overrides."""
    items = ["--config", str(Path(args.config).resolve())] if args.config else []
    for item in overrides_from_args(args):
        items += ["--set", item]
    return items
