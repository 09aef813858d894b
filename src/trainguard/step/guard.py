"""``Guard``: everything between a training loop's backward and its optimizer step, in one call.

::

    guard = trainguard.Guard(run_dir, model, optimizer, scheduler=scheduler, stateful={"data": loader},
                             config="trainguard.yaml")
    def loss_of(model, step, micro_batch):   # micro-batch `micro_batch` of step `step` (from 0)
        return loss_fn(model(batch(step, micro_batch)))

    step = guard.resume()
    while not guard.should_stop(step, total_steps):
        step = guard.step(loss_of).step
    raise SystemExit(guard.close())

The same loop runs in both modes. With ``fault_tolerance.live: true`` the ``Guard`` is one rank of a
live-recovery run (``step/live.py``, docs/live_recovery.md): a rank's death stops no other rank, and its
replacement rejoins with a live peer's state; ``step`` then drives the live rank one committed step per
call. A zero-argument closure (forward and backward of this rank's batch) is the earlier contract,
kept in the closure mode for one release.

``step(loss_of)`` zeroes the gradients, runs the backward of this rank's micro-batches
(``step/micro_batches.py``; a closure instead: runs it, it may run twice, see ``docs/library.md``),
measures the global norm, the loss, the embedding's local norm before clipping and the SDC verdicts with
one all-reduce of constant size, reruns the closure on an SDC detection, decides skip / rollback /
abort, clips, steps the optimizer and the scheduler, saves by policy with the checkpoint's health, and
emits the events and heartbeats. An abort (too many spikes: exit 3, a faulty device: exit 17) ends the
process from inside ``step`` after the last checkpoint commits.

In the closure mode ``Guard`` keeps the run's course (resume, stop, close) and delegates the rest: the
builder (``step/builder.py``) makes every collaborator from the config, the step skeleton
(``step/skeleton.py``) runs the same sequence at every step, and each guard is a plugin of it
(``guards/plugins/``, ``step/plugins/``) answering with a typed ``StepVerdict`` (``guards/step_verdict.py``: apply, skip, rerun,
rollback, abort).
"""

from __future__ import annotations

import contextlib

import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.discovery import newest_committed_step
from trainguard.checkpoint.manager import Stateful
from trainguard.config.load import load_config
from trainguard.config.schema import RunConfig
from trainguard.errors import (
    EXIT_CRASH,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    ConfigErrorExit,
    TrainguardError,
    raised_by_every_rank,
)
from trainguard.guards.sdc import FaultyDeviceError
from trainguard.guards.skip import DataSkipAbort
from trainguard.live.rank import LiveRank
from trainguard.live.replica_mesh import is_replica_group_mesh
from trainguard.live.worker import MicroBatchLoss, SampleRange
from trainguard.runtime.heartbeat import HeartbeatWriter
from trainguard.runtime.lifecycle import EXIT_CODES, NONE, REASON_NAMES
from trainguard.step.live import (closure_only, launcher_rank, live_only, live_rank, started_by_live_launcher,
                                  with_launcher_overrides)
from trainguard.step.micro_batches import DataParallelPlace, micro_batch_closure, step_samples, takes_no_arguments
from trainguard.runtime.outcome import RunOutcome, end_outcome, stop_outcome
from trainguard.step.builder import FIND_EMBEDDING, build_guard_parts, build_step_plugins, input_embedding
from trainguard.step.position import RunPosition
from trainguard.step.saving import StepSaves
from trainguard.step.skeleton import StepOutcome, StepSkeleton
from trainguard.step.static_files import huggingface_files

Config = RunConfig  # the keys of `trainguard train`; a loop of its own uses the sections it needs


def _load(config: str | Path | RunConfig | None, overrides: Sequence[str]) -> RunConfig:
    if isinstance(config, RunConfig):
        if overrides:
            raise ValueError("Guard(overrides=...) applies to a config file (or None), not to a RunConfig")
        return config
    return load_config(config, list(overrides))


def _run_rank(live_argv: list[str] | None) -> int | None:
    """This process's rank in the whole run, None for a live run's warm spare. A live rank's process group
    (if any) is its replica group's, whose first rank is 0 in every group: the launcher's ``--rank`` is the
    run's rank."""
    argv = sys.argv[1:] if live_argv is None else live_argv
    if started_by_live_launcher(argv):
        return launcher_rank(argv)
    return dist.get_rank() if dist.is_initialized() else 0


def _config_errors_end_the_process(init: Callable[..., None]) -> Callable[..., None]:
    """A configuration mistake found while building the guard (a key, a fault site, rollback mode
    without skippable data) is the same on every rank and a restart cannot fix it: rank 0 prints it in
    one line, every rank records exit 2 in its heartbeat (the supervisor never restarts it) and raises
    ``ConfigErrorExit``: uncaught, exit 2 without a traceback; caught, a ``ConfigError``."""

    @functools.wraps(init)
    def build(self: "Guard", run_dir: str | Path, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, run_dir, *args, **kwargs)
        except TrainguardError as error:
            if error.exit_code != EXIT_USAGE:
                raise
            rank = _run_rank(kwargs.get("live_argv"))
            if rank is not None:
                with contextlib.suppress(OSError):  # an unwritable run directory must not mask the error
                    HeartbeatWriter(run_dir, rank).beat("exit", 0, EXIT_USAGE)
            if rank == 0:
                print(f"trainguard: error: [rank 0] {error}", file=sys.stderr, flush=True)
            raise ConfigErrorExit(str(error)) from None

    return build


class Guard:
    """The step protocol of a training loop. Every method is collective: every rank calls it together.

    ``model``: this rank's (sharded) model, or with pipelining its stage's module, with
    ``pipeline_stages`` the pp degree. ``stateful``: objects whose ``state_dict`` rides in every
    checkpoint and is restored for an SDC rerun (the data loader: rollback mode needs one that is
    ``SkippableData``). ``mesh``: the device mesh (for the manifest and the local tier's replica
    groups; default one ``dp_shard`` dimension over the world). ``embedding``: the parameter whose
    local gradient norm decides checkpoint health (default: the model's input embedding; None on a
    rank without it). ``hf_config`` (and ``tokenizer``): written into every checkpoint's
    ``huggingface/`` so that ``trainguard ckpt merge`` needs nothing else. ``tokens_per_step``: global
    tokens of one step, for the ``tokens/s`` figure.

    Live mode (``fault_tolerance.live: true``): ``run_dir`` is the launcher's ``--run-dir``, ``live_argv``
    (default ``sys.argv[1:]``) holds the launcher's flags among the script's own, ``mesh`` must be None
    (live mode shards a replica group's parameters itself), and ``step`` takes a micro-batch loss only;
    ``stateful`` objects are the loop's, updated before each ``step`` and never inside ``loss_of``
    (``live/state.py``); ``embedding`` is read from the summed gradient; ``pipeline_stages`` is refused.
    """

    @_config_errors_end_the_process
    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        stateful: Mapping[str, Stateful] | None = None,
        config: str | Path | RunConfig | None = None,
        *,
        mesh: Any = None,
        pipeline_stages: int = 1,
        embedding: torch.nn.Parameter | None | str = FIND_EMBEDDING,
        hf_config: Any = None,
        tokenizer: Any = None,
        tokens_per_step: int | None = None,
        live_argv: list[str] | None = None,
        overrides: Sequence[str] = (),
    ):
        self.config = cfg = with_launcher_overrides(_load(config, overrides), os.environ)  # and a live launcher's --set
        self._live: LiveRank | None = None
        if cfg.fault_tolerance.live:
            self.run_dir, self.model, self.optimizer = Path(run_dir), model, optimizer
            given = {"mesh": mesh is not None and not is_replica_group_mesh(mesh), "pipeline_stages": pipeline_stages != 1}
            self._live = live_rank(self.run_dir, model, optimizer, scheduler, cfg, live_argv,
                                   unsupported=[name for name, set_ in given.items() if set_],
                                   static_files=huggingface_files(hf_config, tokenizer) if hf_config is not None
                                   else None, stateful=stateful,
                                   embedding=input_embedding(model) if isinstance(embedding, str) else embedding,
                                   tokens_per_step=tokens_per_step)
            self._live_started = False
            self.rank = self._live.args.rank  # a warm spare's: the rank it replaces, once ``resume()`` returned
            return
        if live_argv is not None:
            raise live_only("__init__(live_argv=...)")
        self.run_dir = Path(run_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.parts = parts = build_guard_parts(self.run_dir, model, optimizer, scheduler, stateful, cfg, mesh=mesh,
                                               pipeline_stages=pipeline_stages, embedding=embedding,
                                               hf_config=hf_config, tokenizer=tokenizer,
                                               tokens_per_step=tokens_per_step)
        self.rank = parts.rank
        # the collaborators a loop or an adapter may use: its own events, a save of its own, the heartbeat
        self.checkpoints, self.events, self.lifecycle = parts.checkpoints, parts.events, parts.lifecycle
        self.position = RunPosition(cfg.train.exit_at_step)
        self.saves = StepSaves(parts, cfg, optimizer, scheduler, self.position)
        self.skeleton = StepSkeleton(parts, build_step_plugins(parts), cfg, model, optimizer, scheduler, self.position,
                                     self.saves, tokens_per_step)
        self._pending_stop = NONE
        self._training = False
        self._exit_code: int | None = None
        self._trained = False  # resume() found no stop pending: the loop got to train
        self.outcome = RunOutcome.RUNNING
        """How the run ended (``close()``'s 0 is a finished run, a kill-switch stop or a start that
        trained nothing alike): ``RunOutcome.FINISHED`` alone means the model is the trained one."""

    @property
    def finished(self) -> bool:
        """The run reached ``total_steps``: what a loop checks before exporting the model."""
        return self.outcome is RunOutcome.FINISHED

    @property
    def global_step(self) -> int:
        """The step the run is at: the last one applied, skipped or restored."""
        return self.position.step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self.position.step = step

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> int:
        """Restores the newest verified healthy checkpoint (model, optimizer, scheduler, stateful
        objects, guard state, every RNG) and returns its step, 0 for a fresh start. A stop asked for
        before it (the kill switch exists) loads nothing: ``should_stop`` then answers True."""
        if self._live is not None:  # fresh, resumed by the launcher's choice, or joined: the step it starts at
            return self._started_live().committed_steps
        self._pending_stop = self.lifecycle.decide()
        if self._pending_stop:
            return 0
        self._trained = True
        self.lifecycle.beat("resume", 0)
        try:
            self.global_step = self.checkpoints.resume()
        except TrainguardError as error:  # no checkpoint to resume from (exit 4), a damaged one, ...
            self._abort(error)
        if self.checkpoints.resumed_from is not None:
            # the first step is checked against the state loaded; a fresh start's weights may still be
            # set by the loop after resume() (model.init_from, a user's own load): nothing to compare yet
            self.parts.state.after_update(self.global_step)
        return self.global_step

    # ----------------------------------------------------------------------------- should_stop
    def should_stop(self, step: int, total_steps: int, *, total_named: str = "should_stop(step, total_steps={})"
                    ) -> bool:
        """True when the loop must end: ``total_steps`` (or ``train.exit_at_step``) reached, the kill
        switch, SIGTERM/SIGUSR1, or the time limit near. A stop saves the current step first.
        ``total_named``: where the caller's total comes from, for live mode's line when it is not the
        launcher's ``train.steps`` (an adapter names its own argument)."""
        if self._live is not None:
            return self._live_should_stop(step, total_steps, total_named)
        if self._exit_code is not None:
            return True
        if step != self.global_step:
            raise ValueError(f"should_stop(step={step}): the guard is at step {self.global_step} "
                             "(pass the step that resume() or the last step()'s outcome returned)")
        self.position.total = total_steps
        if self._pending_stop:
            self._stop(self._pending_stop)
            return True
        if not self._training:
            self._training = True
            self.lifecycle.beat("train", step)
            if step == self.position.stop_at == 0:  # exit_at_step=0: the initial weights as a step-0 checkpoint
                self.checkpoints.save(0, self.trainer_state(), stopping=True)
        if step >= self.position.stop_at:
            return True
        reason = self.lifecycle.decide()
        if reason:
            self._stop(reason)
            return True
        return False

    def _stop(self, reason: int) -> None:
        """Saves the current step (if it is not saved yet) and ends the run with the lifecycle's code."""
        why = self.lifecycle.describe(reason)
        step = self.global_step
        if step > 0 and self.checkpoints.due(step, stopping=True).durable:
            self.lifecycle.beat("save", step)
            self.checkpoints.save(step, self.trainer_state(), self.saves.health, stopping=True)
        self.checkpoints.close()
        code = EXIT_CODES[reason]
        self.outcome = stop_outcome(reason, self._trained)
        last_checkpoint = self.checkpoints.last_saved_step
        if self.outcome is RunOutcome.NOT_STARTED:
            # nothing was loaded: the run is where its newest checkpoint is (a fresh run: step 0), not at step 0
            last_checkpoint = newest_committed_step(self.checkpoints.root)
            step = last_checkpoint if last_checkpoint is not None else 0
            why += " at start: nothing loaded or trained"
        saved = f"step {last_checkpoint}" if last_checkpoint is not None else "none"
        self.parts.log.warning("stopping at step %s: %s; exit %d (checkpoint: %s)", step, why, code, saved)
        if self.rank == 0:
            self.events.emit("lifecycle_stop", step=step, reason=REASON_NAMES[reason], message=why, exit_code=code,
                             last_checkpoint=last_checkpoint, outcome=self.outcome.value)
        self.lifecycle.beat("exit", self.global_step, code)
        self._exit_code = code

    # ------------------------------------------------------------------------------------ step
    def step(self, loss_of: MicroBatchLoss | Callable[[], Any], sample_range: SampleRange | None = None) -> StepOutcome:
        """One optimizer step (see the module docstring). ``loss_of(model, step, micro_batch)`` returns the
        (unscaled) loss of micro-batch ``micro_batch`` of step ``step``, counted from 0 (the data position);
        the step's loss is the mean over the global batch (``train.micro_batches`` micro-batches). Or, in
        the closure mode only, the earlier contract for one release: a closure with no arguments that runs
        forward and backward and returns the loss (None on pipeline stages without the loss).
        ``sample_range(step, micro_batch) -> (first, end)`` (optional) names each micro-batch's samples in
        the events. In live mode the call trains until the next step is committed, through any recovery."""
        if self._live is not None:
            return self._live_step(loss_of, sample_range)
        if self._exit_code is not None:
            raise RuntimeError("Guard.step after the run stopped (should_stop returned True)")
        try:
            if takes_no_arguments(loss_of):
                return self.skeleton.run(loss_of)
            if self.parts.ranks_per_stage != self.parts.world_size:
                raise raised_by_every_rank(ConfigError(
                    "guard.step(loss_of) with pipeline_stages > 1: the pipeline schedule runs the micro-batches; "
                    "pass a closure that runs it"))
            micro_batches = self.config.train.micro_batches
            closure = micro_batch_closure(loss_of, self.model, self.global_step, micro_batches,
                                          DataParallelPlace.of(self.parts.mesh, self.rank, self.parts.world_size),
                                          self.config.train.seed)
            samples = step_samples(sample_range, self.global_step, micro_batches) if sample_range else None
            return self.skeleton.run(closure, samples)
        except (DataSkipAbort, FaultyDeviceError, ConfigError) as error:
            self._abort(error)
        except BaseException:
            self.lifecycle.beat("exit", self.global_step, EXIT_CRASH)
            raise

    # ------------------------------------------------------------------------------- live mode
    def steps(self, loss_of: MicroBatchLoss, sample_range: SampleRange | None = None) -> Iterator[int]:
        """Deprecated, kept for one release: live mode's earlier loop, ``for step in guard.steps(loss_of)``,
        now the one loop of both modes spelled as a generator::

            step = guard.resume()
            while not guard.should_stop(step, guard.total_steps):
                step = guard.step(loss_of, sample_range).step
                yield step - 1   # the index of the step just committed

        A step redone after a peer's failure is no longer yielded again. Loop with ``guard.step`` instead."""
        live = self._live_rank("steps(loss_of)")  # refused at the call, not at the first iteration
        warnings.warn("Guard.steps(loss_of) is deprecated: loop with guard.resume(), guard.should_stop(step, total) "
                      "and guard.step(loss_of) (docs/library.md)", DeprecationWarning, stacklevel=2)

        def committed_steps() -> Iterator[int]:
            step = self._started_live(loss_of).committed_steps
            while not self.should_stop(step, live.total_steps):
                step = self.step(loss_of, sample_range).step
                yield step - 1

        return committed_steps()

    @property
    def joined_at(self) -> int | None:
        """Live mode, once ``resume()`` returned: the step at which this process took a rank's place with a
        live peer's state (a replacement, a warm spare; that state was taken inside the step, before a loop
        logged it); None for a fresh or resumed start, and in the closure mode."""
        return self._live.joined_at if self._live is not None else None

    @property
    def total_steps(self) -> int:
        """Live mode: the steps of the run (the launcher's ``train.steps``)."""
        return self._live_rank("total_steps").total_steps

    @property
    def micro_batches(self) -> int:
        """The micro-batches of every step's global batch (``train.micro_batches``; in live mode the
        launcher's), whatever the number of ranks."""
        return self._live.micro_batches if self._live is not None else self.config.train.micro_batches

    def _live_rank(self, call: str) -> LiveRank:
        if self._live is None:
            raise live_only(call)
        return self._live

    def _started_live(self, warm_loss: MicroBatchLoss | None = None) -> LiveRank:
        """The live rank, in its place in the run (``LiveRank.start`` at the first call: a replacement joins
        here; a warm spare warms up with ``warm_loss`` when the first call has one)."""
        if not self._live_started:
            self._live_started = True
            self._live.start(warm_loss)
            if self._live.worker is not None:
                self.rank = self._live.worker.rank
        return self._live

    def _live_should_stop(self, step: int, total_steps: int, total_named: str) -> bool:
        live = self._started_live()
        if live.ended:
            return True
        if total_steps != live.total_steps:  # one line, exit 2, as the closure mode's config errors
            live.end_with_config_error(ConfigError(
                f"{total_named.format(total_steps)}: the live launcher runs {live.total_steps} steps "
                "(config key 'train.steps'); pass the same number (guard.total_steps)"))
        if step != live.committed_steps:
            raise ValueError(f"should_stop(step={step}): the guard is at step {live.committed_steps} "
                             "(pass the step that resume() or the last step()'s outcome returned)")
        return live.stopping

    def _live_step(self, loss_of: MicroBatchLoss | Callable[[], Any], sample_range: SampleRange | None) -> StepOutcome:
        if takes_no_arguments(loss_of):
            raise closure_only("step(closure)")
        live = self._started_live(loss_of)
        if live.stopping:
            raise RuntimeError("Guard.step after the run stopped (should_stop returned True)")
        committed = live.step(loss_of, sample_range)
        if committed is None:  # the run ended inside the step (a data-skip abort, 3; a faulty device, 17; fenced)
            live.close()
        return StepOutcome(committed.index + 1, committed.loss, committed.global_norm,
                           applied=not (committed.skipped or committed.rolled_back), skipped=committed.skipped,
                           rolled_back=committed.rolled_back)

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint's manifest records about the run: step, data position, lr, loss, config."""
        return self.saves.trainer_state()

    # ----------------------------------------------------------------------------------- close
    def close(self) -> int:
        """Waits until the last checkpoint is committed on every rank; returns the exit code: 0, or 16
        after a signal or time-limit stop (0 after the kill switch: ``outcome`` tells them apart). Live mode:
        trains what is left at the last step (a redo, a replacement's join, the final state), then ends the
        process with the quorum's code (``LiveRank.close``) and does not return."""
        if self._live is not None:
            self._live.close()
        if self._exit_code is not None:
            return self._exit_code
        self.checkpoints.close()
        step = self.global_step
        self.outcome = end_outcome(step, self.position.total)
        if self.rank == 0:
            reason = self.outcome.value
            self.events.emit("run_finished", step=step, reason=reason, last_checkpoint=self.checkpoints.last_saved_step)
            self.parts.log.info("run %s at step %d", reason, step)
        self.lifecycle.beat("exit", step, EXIT_OK)
        self._exit_code = EXIT_OK
        return EXIT_OK

    def _abort(self, error: TrainguardError) -> None:
        """Ends the process with the error's exit code, after the save in flight commits (it holds the
        last good state) and the heartbeat's exit record tells the supervisor why."""
        code = error.exit_code
        self.checkpoints.close()
        with contextlib.suppress(OSError):  # a full disk must not mask the error reported below
            self.lifecycle.beat("exit", self.global_step, code)
        if self.rank == 0 or not error.every_rank_raises:
            print(f"trainguard: error: [rank {self.rank}] {error}", file=sys.stderr, flush=True)
        self._exit_code = code
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(code)

