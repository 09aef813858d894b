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
import dataclasses
import json
from pathlib import Path

from trainguard.cli.arguments import make_run_dir
from trainguard.cli.train_live import live_layout, run_live
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.live.launcher import LiveRun
from trainguard.live.placement import place
from trainguard.runtime.hosts import HostNodes, address_toward, parse_hosts
from trainguard.runtime.nodes import SlurmNodes
from trainguard.step.live import LAUNCHER_OVERRIDES_ENV
from trainguard.trainer.arguments import resume_item

LIVE_FLAGS = "--nproc, --config, --set and --resume"
HOST_OPTIONS = ("launcher", "hosts", "node_command")  # the supervisor's options a live run takes: where its ranks run
# a rank on a node of the Slurm allocation: a job step of one task there, sharing the node's CPUs with the
# others (``--overlap``); its end is the launcher's to judge (``--kill-on-bad-exit=0``)
SLURM_STEP = "srun --nodes=1 --ntasks=1 --overlap --kill-on-bad-exit=0 --nodelist={node} --job-name=trainguard-live-{node}"


def run_command_live(args: argparse.Namespace, command: list[str], run_dir: Path) -> int:
    """Runs COMMAND as the ranks of the live run the configuration describes; 0, or 1 with one line when a
    rank failed without being replaced."""
    source = str(args.config) if args.config else "--set"
    config = load_config(args.config, [*args.overrides, *([resume_item(args.resume)] if args.resume else [])])
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
    ranks_set = ((LAUNCHER_OVERRIDES_ENV, json.dumps(args.overrides)),)  # the ranks' Guard applies them too
    run = live_layout(args, config, source, allowed=HOST_OPTIONS, executable=command[0], entry=tuple(command[1:]),
                      rank_env=ranks_set)
    return run_live(on_nodes(args, run), make_run_dir(run_dir))


def on_nodes(args: argparse.Namespace, run: LiveRun) -> LiveRun:
    """``run`` placed on other nodes (``live.placement.place``: replica group g on node g, the nodes after the
    groups' as spare nodes), the store bound to this machine's address on their network: under ``--launcher
    hosts`` the nodes of ``--hosts``, each process started by ``--node-command``; under ``--launcher slurm``
    the allocation's nodes, each process one job step (``SLURM_STEP``); ``run`` itself under ``--launcher local``."""
    if args.launcher != "hosts" and (args.hosts or args.node_command):
        raise ConfigError(f"--hosts and --node-command need --launcher hosts (not {args.launcher})")
    if args.launcher == "local":
        return run
    if args.launcher == "slurm":
        slurm = SlurmNodes.from_environment()  # one line outside an allocation
        addresses, template, given = {name: slurm.address(name) for name in slurm.names}, SLURM_STEP, "the allocation"
    else:
        if not args.hosts or not args.node_command:
            raise ConfigError("--launcher hosts needs --hosts NAME=ADDRESS,... and --node-command TEMPLATE")
        addresses = HostNodes(parse_hosts(args.hosts), args.node_command).addresses  # checks the template too
        template, given = args.node_command, f"--hosts {args.hosts!r}"
    try:
        placement = place(list(addresses), run.groups, run.spares)
    except ValueError as error:
        raise ConfigError(f"{given}: {error} (parallel.dp_replicate = {run.groups})") from None
    return dataclasses.replace(run, nodes=placement.nodes, spare_nodes=placement.spare_nodes,
                               node_addresses=tuple(addresses.items()), node_command=template,
                               store_host=address_toward(next(iter(addresses.values()))))
