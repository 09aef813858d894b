"""``trainguard run [options] -- COMMAND...``: runs COMMAND under the supervisor (restarts, hangs, nodes),
or, given ``--nproc``/``--config``/``--set``/``--resume`` with ``fault_tolerance.live: true``, as the ranks of a live
run (``cli.run_live``).

COMMAND is started once per node slot with ``TRAINGUARD_NODE``, ``TRAINGUARD_NODE_RANK``,
``TRAINGUARD_NNODES``, ``TRAINGUARD_RDZV_ENDPOINT`` and ``TRAINGUARD_INCARNATION`` in its environment;
``trainguard train`` reads them (one elastic agent per node), any other command may.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.cli.arguments import count, seconds
from trainguard.errors import ConfigError

if TYPE_CHECKING:
    from trainguard.runtime.supervisor import SupervisorOptions


def add_supervisor_arguments(parser: argparse.ArgumentParser, max_restarts: int) -> None:
    group = parser.add_argument_group("supervisor")
    added: list[argparse.Action] = []

    def option(*names: str, **details) -> None:
        added.append(group.add_argument(*names, **details))

    option("--max-restarts", type=count, default=max_restarts,
           help=f"restarts after failures before giving up (default {max_restarts})")
    option("--backoff", type=seconds, default=0.5,
           help="seconds before a restart; doubles per failure without progress (default 0.5)")
    option("--crash-loop", type=count, default=2,
           help="give up after this many failures in a row without a new step (default 2)")
    option("--hang-timeout", type=seconds, default=None,
           help="seconds without heartbeat progress that make a hang (default: 10 × the longest "
                "step seen, at least 60)")
    option("--startup-timeout", type=seconds, default=600.0,
           help="seconds allowed before the first step of an incarnation (default 600)")
    option("--nnodes", type=count, default=1, help="nodes the run needs (default 1)")
    option("--spare-nodes", type=count, default=0, help="extra nodes kept in reserve (default 0)")
    option("--node-failures", type=count, default=2,
           help="rank deaths on one node that exclude it when there are several nodes (default 2)")
    option("--doctor", action="store_true",
           help="self-test a spare node with trainguard doctor (burn-in, collectives across the node's "
                "ranks, storage of the run's checkpoints) before it takes a slot; a spare that fails "
                "is excluded too and the next one tried (local launcher)")
    option("--launcher", choices=("local", "slurm", "hosts"), default="local",
           help="local: simulated nodes on this machine; slurm: the allocation's nodes, one srun each; "
                "hosts: the nodes of --hosts, each agent started by --node-command")
    option("--hosts", metavar="NAME=ADDRESS,...",
           help="--launcher hosts: the nodes (slots first, then spares) and the address each listens on")
    option("--node-command", metavar="TEMPLATE",
           help="--launcher hosts: the command that runs a program on a node, {node} and {address} "
                "filled in (e.g. 'ip netns exec {node}'); the agent's environment and command follow it")
    option("--node-timeout", type=seconds, default=30.0,
           help="--launcher hosts: seconds a node's agent may leave the liveness check unanswered "
                "before the node counts as lost and is excluded (default 30)")
    # their defaults, for the live paths that refuse every one given (the live launcher replaces the supervisor)
    parser.set_defaults(supervisor_defaults={action.dest: action.default for action in added})


def options_from_args(args: argparse.Namespace, run_dir: Path, command: list[str]) -> SupervisorOptions:
    # here, not at the top: ``trainguard train`` builds its parser from this module's arguments
    from trainguard.runtime.hang import HangPolicy
    from trainguard.runtime.supervisor import SupervisorOptions

    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be ≥ 1, got {args.nnodes}")
    if args.crash_loop < 1:
        raise ConfigError(f"--crash-loop must be ≥ 1, got {args.crash_loop}")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise ConfigError(f"--hang-timeout must be > 0, got {args.hang_timeout}")
    if args.node_timeout <= 0:
        raise ConfigError(f"--node-timeout must be > 0, got {args.node_timeout}")
    return SupervisorOptions(
        run_dir=run_dir, command=command, max_restarts=args.max_restarts, backoff=args.backoff,
        crash_loop=args.crash_loop, nnodes=args.nnodes, spare_nodes=args.spare_nodes,
        node_failures=max(1, args.node_failures),
        hang=HangPolicy(fixed=args.hang_timeout, startup=args.startup_timeout),
        doctor=spare_self_test(run_dir, getattr(args, "nproc", None) or 1) if args.doctor else None,
        node_timeout=args.node_timeout,
    )


def spare_self_test(run_dir: Path, nproc: int):
    """``trainguard doctor`` on this machine for a simulated spare node: its reason for failing, or None.
    The doctor's faults (``miscompute``) apply when they name no node or this one."""
    def check(node: str) -> str | None:
        from trainguard.doctor import self_test
        from trainguard.faults import active_faults

        mine = [spec.text for spec in active_faults(None)[1]
                if spec.kind == "miscompute" and spec.params.get("node", node) == node]
        report = self_test(run_dir=run_dir, nproc=nproc, faults=";".join(mine))
        return None if report.healthy else report.reason

    return check


def make_nodes(args: argparse.Namespace, fork_run=None):
    from trainguard.runtime.nodes import LocalNodes, SlurmNodes

    if args.launcher == "slurm":
        nodes = SlurmNodes.from_environment()
        if len(nodes.names) < args.nnodes:
            raise ConfigError(f"--nnodes {args.nnodes}: the allocation has only {len(nodes.names)} node(s)")
        return nodes
    if args.launcher == "hosts":
        return host_nodes(args)
    if args.hosts or args.node_command:
        raise ConfigError(f"--hosts and --node-command need --launcher hosts (not {args.launcher})")
    return LocalNodes(args.nnodes + args.spare_nodes, fork_run=fork_run)


def host_nodes(args: argparse.Namespace):
    from trainguard.runtime.hosts import HostNodes, parse_hosts

    if not args.hosts or not args.node_command:
        raise ConfigError("--launcher hosts needs --hosts NAME=ADDRESS,... and --node-command TEMPLATE")
    if args.doctor:
        raise ConfigError("--doctor self-tests a spare on this machine: not available with --launcher hosts")
    addresses = parse_hosts(args.hosts)
    if len(addresses) != args.nnodes + args.spare_nodes:
        raise ConfigError(f"--hosts names {len(addresses)} node(s); --nnodes {args.nnodes} + --spare-nodes "
                          f"{args.spare_nodes} need {args.nnodes + args.spare_nodes}")
    return HostNodes(addresses, args.node_command)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a training command under the supervisor",
                                   usage="trainguard run [options] -- COMMAND...")
    parser.add_argument("--run-dir", help="the run directory (default: COMMAND's --run-dir)")
    add_supervisor_arguments(parser, max_restarts=10)
    parser.add_argument("--kill-switch", metavar="PATH",
                        help="the run's kill switch file (lifecycle.kill_switch_path): while it exists, start no "
                             "ranks and exit 0 at once (and cancel a job array's pending tasks)")
    live = parser.add_argument_group("live recovery (fault_tolerance.live: true; docs/live_recovery.md)")
    live.add_argument("--nproc", type=int, help="ranks of the live run: COMMAND started once per rank by the live "
                                                "launcher, its flags appended (required with live recovery)")
    live.add_argument("--config", help="YAML config file with fault_tolerance.live: true: the live run's layout, "
                                       "steps, global batch, spares and drill (faults: kill:rank=R,step=S)")
    live.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a key of that configuration; repeatable")
    live.add_argument("--resume", metavar="MODE",
                      help="checkpoint.resume of the live run: auto (the newest verified durable checkpoint of "
                           "the run directory, the default), disable, or a global_step_N PATH")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    parser.set_defaults(func=run)


def _run_dir_of(command: list[str]) -> str | None:
    for i, item in enumerate(command):
        if item == "--run-dir" and i + 1 < len(command):
            return command[i + 1]
        if item.startswith("--run-dir="):
            return item.split("=", 1)[1]
    return None


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to run: trainguard run [options] -- COMMAND...")
    if command[0].startswith("-"):
        raise ConfigError(f"unknown option {command[0]!r} (the command goes after --)")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"command not found: {command[0]!r}")
    run_dir = args.run_dir or _run_dir_of(command)
    if run_dir is None:
        raise ConfigError("--run-dir is required (or give COMMAND a --run-dir)")
    run_dir = Path(run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: exists and is not a directory")
    if args.nproc is not None or args.config is not None or args.overrides or args.resume is not None:
        from trainguard.cli.run_live import run_command_live

        return run_command_live(args, command, run_dir)
    from trainguard.runtime.supervisor import Supervisor

    options = options_from_args(args, run_dir, command)
    options.kill_switch = Path(args.kill_switch) if args.kill_switch else None
    return Supervisor(options, nodes=make_nodes(args)).run()
