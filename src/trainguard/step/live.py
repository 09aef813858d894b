"""``Guard``'s live mode (``fault_tolerance.live: true``, docs/live_recovery.md): the rank it hands the
loop to (``trainguard.live.rank.LiveRank``) and the errors that keep the two modes apart.

In live mode the launcher's flags place the rank (``LiveArgs``); the loop is the closure mode's
(``resume``, ``should_stop``, ``step(loss_of)``, ``close``), and each ``guard.step(loss_of)`` drives the
live rank to its next committed step (one backward per micro-batch, so that the survivors can compute a
failed group's micro-batches); the model, the optimizer, the guards' counters, the LR scheduler (any)
and the loop's ``stateful`` objects are the whole state of the run (``live/state.py``). Live mode runs the
durable tier (``live/durable.py``: its interval, retention, resume, async and writer keys), the local and
memory tiers (``live/local_tier.py``), the mirror of durable checkpoints (``checkpoint.mirror.*``; a mirror
URL to resume from is restored by the launcher: ``live.launcher.resume_point``), data skip and the skip streak (``live/step_judge.py``: the closure mode's
plugins and ``decide``; ``guards.skip.*``, ``guards.max_consecutive_skips``), rollback mode (the same plugins:
``guards.check_for_global_norm``, ``guards.rollback.*``; its skipped data positions: ``live/data_positions.py``), SDC detection with its rerun (``live/sdc.py``: ``guards.sdc.*``), replica
fingerprints (``live/fingerprint.py``: ``guards.fingerprint.*``), checkpoint health and the embedding
monitor (``LiveWorker.health``: ``guards.health.*``, ``guards.monitor``), the kill switch, the time limit and ``train.exit_at_step``
(``LiveWorker.stop_here``), the heartbeat files (``lifecycle.heartbeats``), each rank's per-parameter local
gradient norms (``guards.local_norm``) and the closure mode's step line every ``train.log_interval`` steps (by the
quorum's first member), and writes ``hf_config`` (and the tokenizer) into every durable checkpoint: every key of
the ``checkpoint``, ``guards`` and ``lifecycle`` sections. A mesh other than the replica group's and pipeline stages are refused, never ignored. The
faults in force may only be the live drill (``trainguard.live.drill``: the launcher's kill, the
ranks' gradient, module, state, hang and checkpoint faults), which the rank checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.manager import Stateful
from trainguard.config.load import with_overrides
from trainguard.config.schema import RunConfig
from trainguard.errors import ConfigError
from trainguard.guards.sdc import sdc_config_from_env
from trainguard.live.drill import gradient_faults, live_drill, local_tier_nodes, site_faults
from trainguard.live.fsdp_share import fsdp_modules
from trainguard.live.rank import LiveRank
from trainguard.live.state import loop_objects
from trainguard.live.worker import LiveArgs, LiveRules

LAUNCHER_OVERRIDES_ENV = "TRAINGUARD_SET"
"""The live launcher's ``--set`` items (a JSON list), handed to its ranks: ``Guard`` applies them on top of
the configuration the script gives it, so a key set on the command line means the same to the ranks as to
the launcher."""


def live_only(call: str) -> ConfigError:
    """A live-mode call on a ``Guard`` whose configuration has live recovery off."""
    return ConfigError(f"Guard.{call} needs live recovery: set config key 'fault_tolerance.live' to true and start "
                       "the ranks with the live launcher (docs/live_recovery.md); without it, train with "
                       "guard.step(closure)")


def closure_only(call: str) -> ConfigError:
    """A call of the closure mode on a ``Guard`` in live mode."""
    return ConfigError(f"Guard.{call} is refused with fault_tolerance.live: true: live recovery needs the loss of "
                       "each micro-batch, so that the survivors can compute a failed group's micro-batches; pass "
                       "guard.step(loss_of) the loss of one micro-batch, loss_of(model, step, micro_batch), which "
                       "runs in both modes (docs/library.md)")


def with_launcher_overrides(config: RunConfig, environ: Mapping[str, str]) -> RunConfig:
    """``config`` with the live launcher's ``--set`` items (``LAUNCHER_OVERRIDES_ENV`` in ``environ``)
    applied as ``load_config`` applies them (``config.load.with_overrides``); ``config`` itself when there
    are none."""
    text = environ.get(LAUNCHER_OVERRIDES_ENV)
    if not text:
        return config
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"{LAUNCHER_OVERRIDES_ENV}={text!r}: expected a JSON list of SECTION.KEY=VALUE strings")
    return with_overrides(config, items)


def started_by_live_launcher(argv: list[str]) -> bool:
    """Whether the live launcher started this process: its ``--store`` flag is among the arguments."""
    return any(arg == "--store" or arg.startswith("--store=") for arg in argv)


def launcher_rank(argv: list[str]) -> int | None:
    """The rank the live launcher gave this process (its ``--rank R``), None for a warm spare (``--spare``),
    which has no rank until it replaces one."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--rank", type=int)
    return parser.parse_known_args(argv)[0].rank


def live_rank(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
              config: RunConfig, argv: list[str] | None, unsupported: list[str],
              static_files: Callable[[Path], None] | None = None,
              stateful: Mapping[str, Stateful] | None = None,
              embedding: torch.nn.Parameter | None = None, tokens_per_step: int | None = None) -> LiveRank:
    """This process's rank of the live run, after refusing what live mode would not do: ``unsupported``
    (the ``Guard`` arguments given that it cannot honour), a process the live launcher did not start, a run directory that
    is not the launcher's, or faults in force other than the launcher's drill. ``argv``: the command line with the
    launcher's flags (default ``sys.argv[1:]``). ``static_files``: writes ``huggingface/`` into each durable
    checkpoint. ``scheduler`` (any, stepped with each applied update) and ``stateful`` (the loop's objects)
    travel and are saved as ``live/state.py`` says. ``embedding``: the parameter whose gradient norm
    ``guards.health`` and ``guards.monitor`` read (refused missing when either is on). ``tokens_per_step``: the
    global tokens of one step, for the step line's ``tokens/s``."""
    if unsupported:
        raise ConfigError(f"Guard({', '.join(f'{name}=...' for name in unsupported)}): not supported with "
                          "fault_tolerance.live: true (live mode shards a replica group's parameters itself and does "
                          "not do the others: docs/live_recovery.md, \"Not done yet\")")
    if embedding is None and (config.guards.health.enabled or config.guards.monitor):
        key = "guards.health.enabled" if config.guards.health.enabled else "guards.monitor"
        raise ConfigError(f"config key {key!r}: the model has no input embedding whose gradient norm it would read; "
                          "pass Guard(embedding=PARAMETER), or turn it off")
    argv = sys.argv[1:] if argv is None else argv
    if not started_by_live_launcher(argv):  # torchrun's, or no launcher
        raise ConfigError("fault_tolerance.live: true, but this process was not started by the live launcher (no "
                          "--store among its arguments); start the ranks with trainguard run --nproc N --config FILE -- COMMAND "
                          "(docs/live_recovery.md)")
    args = LiveArgs.parse(argv)
    if Path(run_dir).resolve() != args.run_dir.resolve():
        raise ConfigError(f"Guard(run_dir={str(run_dir)!r}): the live launcher started this rank with --run-dir "
                          f"{str(args.run_dir)!r}; pass that one")
    # checked as the launcher checks them (the kill is the launcher's)
    live_drill(config.faults, args.world, args.steps,
               local_nodes=local_tier_nodes(config.checkpoint.local_interval, config.parallel.ranks_per_node, args.world))
    if config.fault_tolerance.fsdp and not fsdp_modules(model):
        raise ConfigError("config key 'fault_tolerance.fsdp' is true but the model has no FSDP2 module: shard it with "
                          "fully_shard(module, mesh=trainguard.data_parallel_mesh()), or turn the key off (live mode "
                          "then shards the parameters by rows itself)")
    rules = LiveRules(grad_clip=config.optim.grad_clip, skip=config.guards.skip,
                      max_consecutive_skips=config.guards.max_consecutive_skips,
                      gradient_faults=gradient_faults(config.faults), site_faults=site_faults(config.faults),
                      sdc=sdc_config_from_env(config.guards.sdc), fingerprint=config.guards.fingerprint,
                      exit_at_step=config.train.exit_at_step, health=config.guards.health,
                      monitor=config.guards.monitor, lifecycle=config.lifecycle,
                      ranks_per_node=config.parallel.ranks_per_node,
                      max_step_failures=config.fault_tolerance.max_step_failures,
                      rollback=config.guards.rollback if config.guards.check_for_global_norm else None,
                      local_norm=config.guards.local_norm, log_interval=config.train.log_interval,
                      tokens_per_step=tokens_per_step)
    return LiveRank(model, optimizer, args, scheduler, seed=config.train.seed, checkpoint=config.checkpoint,
                    rules=rules, static_files=static_files, stateful=loop_objects(stateful), embedding=embedding)
