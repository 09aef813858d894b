"""``trainguard train`` with ``fault_tolerance.live: true``: the reference trainer's ranks started by the
live launcher (``trainguard.trainer.live``), which keeps the surviving replica groups stepping through a
rank's failure instead of restarting the job (docs/live_recovery.md).

What the live path does not do is refused before anything starts, with one line naming it: the keys of
the closure mode's sections (checkpoints, guards, lifecycle) that live mode does not run
(``step.live.refuse_closure_mode_keys``), ``model.init_from``, the supervisor's options (the live
launcher replaces the supervisor), a layout that is not whole replicas and a fault other than the live
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
from trainguard.errors import EXIT_DATA_SKIP_ABORT, ConfigError
from trainguard.live.launcher import LiveRun, resume_point
from trainguard.live.supervise import supervise
from trainguard.runtime.lifecycle import REASON_NAMES, SIGNAL
from trainguard.step.live import refuse_closure_mode_keys
from trainguard.topology import resolve_layout
from trainguard.trainer.arguments import config_arguments

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
    refuse_closure_mode_keys(config, source)
    refuse_supervisor_options(args, allowed)
    layout = resolve_layout(config.parallel, args.nproc)
    config.parallel.dp_shard = layout.dp_shard  # the ranks of a replica group, derived from --nproc as usual
    return LiveRun.from_config(config, source, micro_batch_s=0.0, checkpoint_every=0, timeout_s=math.inf, **program)


def live_run(args: argparse.Namespace, config: RunConfig, source: str) -> LiveRun:
    """The reference trainer's live run (``live_layout``); ``model.init_from`` refused."""
    if config.model.init_from is not None:
        raise ConfigError(f"{source}: config key 'model.init_from' is not supported with fault_tolerance.live: true "
                          "(every rank builds its model from the seed)")
    return live_layout(args, config, source, entry=("-m", "trainguard.trainer.live", *config_arguments(args)))


def run_live(run: LiveRun, run_dir: Path) -> int:
    """Trains to the end; 0, or the quorum's agreed code after a stop or an abort (``LiveResult.exit_code``:
    16 after a SIGTERM or the time limit, the quorum saved a step; 0 after the kill switch or
    ``train.exit_at_step``, saved too; 3 after a data-skip abort), or 1 with one line when a rank failed
    without being replaced."""
    where = (f" on hosts {', '.join(run.nodes[:run.groups])}, spare nodes {', '.join(run.spare_nodes) or 'none'}, "
             f"store at {run.store_host}" if run.nodes else "")
    print(f"trainguard: run directory {run_dir} (live recovery: {run.groups} replica groups of "
          f"{run.group_size} ranks, {run.spares} spares{where})", flush=True)
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
        print(f"trainguard: live run aborted by the data-skip guard: exit {EXIT_DATA_SKIP_ABORT}; the newest "
              f"checkpoint is {saved}", flush=True)
        return EXIT_DATA_SKIP_ABORT
    if result.stop is not None:
        again = "; run again with --resume auto to continue" if result.stopped else ""
        if result.stop["reason"] == REASON_NAMES[SIGNAL]:
            print(f"trainguard: live run stopped by SIGTERM/SIGUSR1: saved {saved}{again}", flush=True)
        else:
            print(f"trainguard: live run stopped at step {result.stop['step']}: {result.stop['message']}; saved "
                  f"{saved}{again}", flush=True)
        return result.exit_code
    print(f"trainguard: live run finished: {run.steps} steps in {result.wall_s:.1f} s, "
          f"ranks replaced: {sorted(result.replaced_at) or 'none'}", flush=True)
    return 0
