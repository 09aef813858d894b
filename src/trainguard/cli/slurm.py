"""``trainguard slurm sbatch [options] -- TRAIN ARGS``: writes (and optionally submits) a Slurm job script."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from trainguard.cli.arguments import count
from trainguard.errors import ConfigError
from trainguard.runtime.slurm import JobSpec, render_job_script


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("slurm", help="Slurm helpers")
    commands = parser.add_subparsers(dest="slurm_command", required=True, metavar="{sbatch}",
                                     parser_class=type(parser))
    sbatch = commands.add_parser("sbatch", help="write a job-array script that runs the trainer supervised",
                                 usage="trainguard slurm sbatch [options] -- TRAIN ARGS")
    sbatch.add_argument("--run-dir", required=True, help="the run directory (its nodes/excluded.json is honoured)")
    sbatch.add_argument("--job-name", help="Slurm job name (default: the run directory's name)")
    sbatch.add_argument("--nodes", type=count, default=1, help="nodes the run trains on (default 1)")
    sbatch.add_argument("--spare-nodes", type=count, default=0, help="extra nodes allocated as spares (default 0)")
    sbatch.add_argument("--nproc-per-node", type=count, default=1, help="ranks per node (default 1)")
    sbatch.add_argument("--time", default="100:00:00", help="time limit per job (default 100:00:00)")
    sbatch.add_argument("--signal-seconds", type=count, default=90,
                        help="USR1 this many seconds before the limit (default 90)")
    sbatch.add_argument("--array", type=count, default=10, help="jobs in the array, run one at a time (default 10)")
    sbatch.add_argument("--exit-margin-mins", type=float, default=10.0,
                        help="lifecycle.exit_duration_in_mins = --time minus this (default 10)")
    sbatch.add_argument("--partition")
    sbatch.add_argument("--account")
    sbatch.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        help="another #SBATCH line, e.g. --sbatch-option=--gres=gpu:8; repeatable")
    sbatch.add_argument("--max-restarts", type=count, default=10, help="the supervisor's --max-restarts (default 10)")
    sbatch.add_argument("--hang-timeout", type=float, default=None,
                        help="the supervisor's --hang-timeout in seconds (default: its own)")
    sbatch.add_argument("--kill-switch", metavar="PATH",
                        help="kill switch file: sets lifecycle.kill_switch_path, and while it exists the array's "
                             "tasks start no ranks and its pending tasks are cancelled")
    sbatch.add_argument("--out", help="script path (default RUN_DIR/JOB_NAME.slurm)")
    sbatch.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    sbatch.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of trainguard train")
    sbatch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainguard.runtime.supervisor import load_excluded  # here: the supervisor would slow every parser's start

    train_args = list(args.train_args)
    if train_args and train_args[0] == "--":
        train_args = train_args[1:]
    for flag in ("--run-dir", "--nproc"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in train_args):
            raise ConfigError(f"{flag} is set by trainguard slurm sbatch; leave it out of TRAIN ARGS")
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be ≥ 1, got {args.nodes}")
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: exists and is not a directory")
    name = args.job_name or run_dir.name
    spec = JobSpec(job_name=name, run_dir=str(run_dir), train_args=train_args, python=sys.executable,
                   nodes=args.nodes, spare_nodes=args.spare_nodes, nproc_per_node=max(1, args.nproc_per_node),
                   time=args.time, signal_seconds=args.signal_seconds, array=max(1, args.array),
                   exit_margin_mins=args.exit_margin_mins, excluded=sorted(load_excluded(run_dir)),
                   partition=args.partition, account=args.account, extra_sbatch=args.sbatch_option,
                   supervisor_args=["--max-restarts", str(args.max_restarts)])
    if args.hang_timeout is not None:
        spec.supervisor_args += ["--hang-timeout", f"{args.hang_timeout:g}"]
    if args.kill_switch:
        switch = str(Path(args.kill_switch).resolve())
        spec.supervisor_args += ["--kill-switch", switch]
        spec.train_args = [*spec.train_args, "--set", f"lifecycle.kill_switch_path={switch}"]
    try:
        text = render_job_script(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out = Path(args.out) if args.out else run_dir / f"{name}.slurm"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    os.chmod(out, 0o755)
    print(f"wrote {out}" + (f" (excluding {', '.join(spec.excluded)})" if spec.excluded else ""))
    if args.submit:
        return subprocess.run(["sbatch", str(out)]).returncode
    return 0
