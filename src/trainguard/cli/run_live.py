"""``trainguard run --nproc N --config FILE [--set KEY=VALUE ...] -- COMMAND...`` with
``fault_tolerance.live: true``: COMMAND (a user's script training through ``Guard`` in live mode) is
started as each of the N ranks of a live run by the live launcher (store, lighthouse, warm spares), the
launcher's flags appended (``--store ... --rank R --run-dir DIR ...``, which ``Guard`` reads); a rank's
failure is replaced while the others keep stepping (docs/live_recovery.md). The configuration gives the
layout, the steps, the global batch, the ``fault_tolerance`` keys and the drill (``faults``:
``kill:rank=R,step=S``, ``trainguard.live.drill``) and where the job resumes (``--resume``, which is
``checkpoint.resume``: the launcher chooses the checkpoint and hands it to the ranks); COMMAND loads its
own (the same file) for ``Guard``, which applies the ``--set`` items on top (``TRAINGUARD_SET`` in the
ranks' environment).

Under ``--launcher hosts`` (``--hosts``, ``--node-command``, as the supervisor takes them) or ``--launcher
slurm`` (the allocation's nodes, each rank a job step) the ranks run on those nodes (``on_nodes``,
``live.placement``) and the store listens on this machine's address on their network.

What does not apply is refused before anything starts, one line: the supervisor's other options, no
``--nproc``, a configuration with live recovery off, and what
``cli.train_live.live_layout`` refuses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainguard.cli.arguments import make_run_dir
from trainguard.cli.train_live import HOST_OPTIONS, live_layout, on_nodes, run_live
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.step.live import LAUNCHER_OVERRIDES_ENV
from trainguard.trainer.arguments import resume_item

LIVE_FLAGS = "--nproc, --config, --set and --resume"


def run_command_live(args: argparse.Namespace, command: list[str], run_dir: Path) -> int:
    """Runs COMMAND as the ranks of the live run the configuration describes; 0, or 1 with one line when a
    rank failed without being replaced."""
    source = str(args.config) if args.config else "--set"
    overrides = [*args.overrides, *([resume_item(args.resume)] if args.resume else [])]
    config = load_config(args.config, overrides)
    if not config.fault_tolerance.live:
        raise ConfigError(f"{source}: {LIVE_FLAGS} start a live run, and config key 'fault_tolerance.live' is not "
                          "true; without live recovery trainguard run supervises COMMAND, which reads its own "
                          "configuration (leave them out)")
    if args.nproc is None or args.nproc < 1:
        raise ConfigError(f"--nproc is required with fault_tolerance.live: true, ≥ 1 (the ranks of the live run, "
                          f"each one COMMAND), got {args.nproc}")
    if args.kill_switch:
        raise ConfigError("--kill-switch: a supervisor option; with fault_tolerance.live: true the live launcher "
                          "starts and replaces the ranks instead")
    # the ranks' Guard applies them too (--resume's mode: whether a rank may resume from its local tiers)
    ranks_set = ((LAUNCHER_OVERRIDES_ENV, json.dumps(overrides)),)
    run = live_layout(args, config, source, allowed=HOST_OPTIONS, executable=command[0], entry=tuple(command[1:]),
                      rank_env=ranks_set)
    return run_live(on_nodes(args, run), make_run_dir(run_dir))
