"""``trainguard train`` with ``fault_tolerance.live: true``: the reference trainer's ranks started by the
live launcher (``trainguard.trainer.live``), which keeps the surviving replica groups stepping through a
rank's failure instead of restarting the job (docs/live_recovery.md).

What the live path does not do is refused before anything starts, with one line naming it:
``model.init_from``, the supervisor's options (the live
launcher replaces the supervisor) but where the ranks run (``--launcher hosts|slurm``, ``--hosts``,
``--node-command``: ``on_nodes``), a layout that is not whole replicas and a fault other than the live
drill's (``LiveRun.from_config``). ``trainguard run``'s live path (``cli.run_live``)
starts a user's command the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from trainguard.checkpoint.discovery import newest_committed
from trainguard.config.schema import RunConfig
from trainguard.errors import EXIT_DATA_SKIP_ABORT, EXIT_RESUMABLE_STOP, EXIT_STEP_FAILED, EXIT_USAGE, ConfigError
from trainguard.live.launcher import LiveRun, resume_point
from trainguard.live.placement import place
from trainguard.live.supervise import supervise
from trainguard.runtime import early_signals
from trainguard.runtime.hosts import HostNodes, address_toward, parse_hosts
from trainguard.runtime.lifecycle import REASON_NAMES, SIGNAL
from trainguard.runtime.nodes import SlurmNodes
from trainguard.topology import resolve_layout
from trainguard.trainer.arguments import config_arguments

HOST_OPTIONS = ("launcher", "hosts", "node_command")  # the supervisor's options a live run takes: where its ranks run
# a rank on a node of the Slurm allocation: a job step of one task there, sharing the node's CPUs with the
# others (``--overlap``); its end is the launcher's to judge (``--kill-on-bad-exit=0``)
SLURM_STEP = "srun --nodes=1 --ntasks=1 --overlap --kill-on-bad-exit=0 --nodelist={node} --job-name=trainguard-live-{node}"


def refuse_supervisor_options(args: argparse.Namespace, allowed: tuple[str, ...] = ()) -> None:
    """One line naming the first supervisor option given but ``allowed``'s: the live launcher starts and
    replaces the ranks."""
    for name, default in args.supervisor_defaults.items():
        if name not in allowed and getattr(args, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')}: a supervisor option; with fault_tolerance.live: true the "
                              "live launcher starts and replaces the ranks instead")


def live_layout(args: argparse.Namespace, config: RunConfig, source: str, allowed: tuple[str, ...] = (),
                **program: object) -> LiveRun:
    """The live run of ``--nproc`` ranks the configuration describes, each running ``program`` (LiveRun's
    ``entry``, ``executable``), its drill the faults in force; or a ``ConfigError`` naming what the live
    path does not do (a supervisor option but ``allowed``'s)."""
    refuse_supervisor_options(args, allowed)
    layout = resolve_layout(config.parallel, args.nproc)
    config.parallel.dp_shard = layout.dp_shard  # the ranks of a replica group, derived from --nproc as usual
    return LiveRun.from_config(config, source, micro_batch_s=0.0, checkpoint_every=0, timeout_s=math.inf, **program)


def live_run(args: argparse.Namespace, config: RunConfig, source: str) -> LiveRun:
    """The reference trainer's live run (``live_layout``); ``model.init_from`` refused. With
    ``fault_tolerance.fsdp`` its ranks shard the model with FSDP2 inside each replica group (``trainer/live.py``)."""
    if config.model.init_from is not None:
        raise ConfigError(f"{source}: config key 'model.init_from' is not supported with fault_tolerance.live: true "
                          "(every rank builds its model from the seed)")
    return on_nodes(args, live_layout(args, config, source, allowed=HOST_OPTIONS,
                                      entry=("-m", "trainguard.trainer.live", *config_arguments(args))))


def run_live(run: LiveRun, run_dir: Path) -> int:
    """Trains to the end; 0, or the quorum's agreed code after a stop or an abort (``LiveResult.exit_code``:
    16 after a SIGTERM or the time limit, the quorum saved a step; 0 after the kill switch or
    ``train.exit_at_step``, saved too; 3 after a data-skip abort; 19 after a step that failed
    ``fault_tolerance.max_step_failures`` times in a row), or 1 with one line when a rank failed without being replaced."""
    where = (f" on hosts {', '.join(run.nodes[:run.groups])}, spare nodes {', '.join(run.spare_nodes) or 'none'}, "
             f"store at {run.store_host}" if run.nodes else "")
    print(f"trainguard: run directory {run_dir} (live recovery: {run.groups} replica groups of "
          f"{run.group_size} ranks, {run.spares} spares{where})", flush=True)
    held = early_signals.release()  # SIGTERM/SIGUSR1 while the command was starting: nothing is started
    if held:
        print(f"trainguard: received {held[-1].name}: starting no ranks, exit {EXIT_RESUMABLE_STOP}", flush=True)
        return EXIT_RESUMABLE_STOP
    resume = resume_point(run, run_dir)  # exit 4 (one line) when checkpoints exist and none qualifies
    if resume is not None:
        print(f"trainguard: live run resumes from {resume} (checkpoint.resume: {run.resume})", flush=True)
    run = dataclasses.replace(run, resume=str(resume) if resume is not None else "disable")  # chosen once
    try:
        result = supervise(run_dir, run)  # the launcher in a child process, started again if it dies
    except RuntimeError as error:
        print(f"trainguard: error: {error}", file=sys.stderr, flush=True)
        return 1
    newest = newest_committed(run_dir / "checkpoints")
    saved = newest.path if newest is not None else None
    if result.exit_code == EXIT_DATA_SKIP_ABORT:  # the ranks printed the guard's line
        print(f"trainguard: live run aborted by the data-skip guard: exit {EXIT_DATA_SKIP_ABORT}"
              f"{abort_reason_words(result.stop)}; {newest_checkpoint_words(saved)}", flush=True)
        return EXIT_DATA_SKIP_ABORT
    if result.exit_code == EXIT_USAGE:  # every rank made the same configuration error; the first printed it
        return EXIT_USAGE
    if result.exit_code == EXIT_STEP_FAILED:  # the ranks printed the step's error, or the restore's
        print(f"trainguard: live run ended: {step_failed_words(result.stop)}: exit {EXIT_STEP_FAILED}; "
              f"{newest_checkpoint_words(saved)}", flush=True)
        return EXIT_STEP_FAILED
    if result.stop_overdue_s is not None:
        print(f"trainguard: live run stopped by SIGTERM/SIGUSR1: its ranks had not stopped within "
              f"{result.stop_overdue_s:.0f} s and were ended, nothing more saved; {newest_checkpoint_words(saved)}; "
              "run again with --resume auto to continue", flush=True)
        return EXIT_RESUMABLE_STOP
    if result.stop is not None:
        print(stop_line(result.stop, saved, result.stopped), flush=True)
        return result.exit_code
    print(f"trainguard: live run finished: {run.steps} steps in {result.wall_s:.1f} s, "
          f"ranks replaced: {sorted(result.replaced_at) or 'none'}"
          + (f", ranks given up: {sorted(result.given_up)}" if result.given_up else ""), flush=True)
    return 0


def abort_reason_words(stop: dict | None) -> str:
    """After the abort line's contract words: a rollback abort's reason (the rollback guard's message, which
    starts "rollback: "), as rollback mode aborts with the data-skip guard's exit code."""
    if stop is None or stop["reason"] != "rollback":
        return ""
    return f" ({stop['message']})"


def step_failed_words(stop: dict | None) -> str:
    """What ended a live run with exit 19, from the quorum's record (``LiveStop``): a step that failed too often,
    or a restore with no checkpoint left that loads (the ranks' own line names the checkpoints and errors)."""
    if stop is not None and stop["reason"] == "restore_failed":
        return (f"the restore before step {stop['step'] + 1} found no checkpoint that loads (each failed "
                "fault_tolerance.max_step_failures times)")
    return "a step failed fault_tolerance.max_step_failures times in a row"


def newest_checkpoint_words(saved: Path | None) -> str:
    return f"the newest checkpoint is {saved}" if saved is not None else "no checkpoint was committed"


def stop_line(stop: dict, saved: Path | None, resumable: bool) -> str:
    """The command's line after the quorum's agreed stop (its ``lifecycle_stop`` event); ``saved``: the
    newest committed checkpoint, None when there is none (a start with the kill switch armed)."""
    what = f"saved {saved}" if saved is not None else "nothing saved"
    again = "; run again with --resume auto to continue" if resumable else ""
    if stop["reason"] == REASON_NAMES[SIGNAL]:
        return f"trainguard: live run stopped by SIGTERM/SIGUSR1: {what}{again}"
    return f"trainguard: live run stopped at step {stop['step']}: {stop['message']}; {what}{again}"


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
