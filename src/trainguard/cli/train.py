"""``trainguard train``: validates the configuration, then starts torchrun on this machine."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from trainguard.cli.run import add_supervisor_arguments
from trainguard.errors import ConfigError
from trainguard.trainer.arguments import add_train_arguments, config_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="run the reference trainer on this machine")
    add_train_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1, help="number of training processes (ranks) per node")
    add_supervisor_arguments(parser, max_restarts=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs, not when its parser is built: they import torch and transformers
    from trainguard.checkpoint.resume import check_explicit_resume_path
    from trainguard.cli.arguments import make_run_dir
    from trainguard.cli.train_live import live_run, run_live
    from trainguard.faults.injector import active_faults, check_fault_ranks
    from trainguard.runtime.nodes import ENV_NNODES, ENV_SUPERVISED
    from trainguard.topology import resolve_layout
    from trainguard.trainer.entry import config_from_args
    from trainguard.trainer.expert_layout import check_expert_layout
    from trainguard.trainer.model import build_model_config

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be ≥ 1, got {args.nproc}")
    config = config_from_args(args)
    live = live_run(args, config, str(args.config) if args.config else "--set") if config.fault_tolerance.live else None
    supervised = bool(os.environ.get(ENV_SUPERVISED))
    if live is not None and supervised:
        raise ConfigError("fault_tolerance.live: true under a supervisor (trainguard run): the live launcher starts "
                          "and replaces the ranks itself; run trainguard train directly")
    nnodes = int(os.environ.get(ENV_NNODES, "1")) if supervised else args.nnodes
    world_size = args.nproc * max(1, nnodes)
    layout = resolve_layout(config.parallel, world_size)
    check_expert_layout(build_model_config(config.model, config.data.seq_len), layout)
    source, faults = active_faults(config.faults)
    try:
        check_fault_ranks(faults, world_size)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if config.checkpoint.resume not in ("auto", "disable") and "://" not in config.checkpoint.resume:
        check_explicit_resume_path(Path(config.checkpoint.resume))
    run_dir = make_run_dir(Path("runs") / time.strftime("%Y%m%d-%H%M%S") if args.run_dir is None else args.run_dir)
    if live is not None:
        return run_live(live, run_dir)
    worker_args = ["--run-dir", str(run_dir), *config_arguments(args)]
    if supervised:  # an agent started by a supervisor (``trainguard run -- trainguard train ...``, or below)
        from trainguard.runtime.launcher import launch_local
        from trainguard.trainer.entry import run_worker

        code = launch_local(args.nproc, worker_args, run_dir, run_worker, preload=("trainguard.trainer.loop",))
        sys.stdout.flush()
        sys.stderr.flush()
        # the interpreter's teardown after torch.distributed takes seconds, and a restart waits for it
        os._exit(code)
    from trainguard.cli.run import make_nodes, options_from_args
    from trainguard.runtime.supervisor import Supervisor

    command = [sys.executable, "-m", "trainguard", "train", "--nproc", str(args.nproc), *worker_args]
    options = options_from_args(args, run_dir, command)
    if args.launcher == "local":
        import trainguard.trainer.loop  # noqa: F401  (imported once here, inherited by every forked agent)
    options.restart_command = command + ["--set", "checkpoint.resume=auto"]  # a restart resumes the newest
    print(f"trainguard: run directory {run_dir}", flush=True)
    return Supervisor(options, nodes=make_nodes(args, fork_run=_run_agent)).run()


def _run_agent(command: list[str]) -> int:
    """A forked node agent: ``command`` is ``python -m trainguard train ...``, run here, not exec'd."""
    from trainguard.cli import main

    return main(command[3:])

