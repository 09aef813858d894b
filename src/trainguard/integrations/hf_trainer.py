"""trainguard in a Hugging Face ``transformers.Trainer``: ``GuardedTrainer``.

::

    trainer = GuardedTrainer(run_dir, model=model, args=TrainingArguments(..., max_steps=1000),
                             train_dataset=dataset, guard_config="trainguard.yaml")
    trainer.train()
    exit_code = trainer.exit_code              # 0, 16 after a signal / time-limit stop: the supervisor's cue
    torch.distributed.barrier()                # then destroy: the Trainer leaves the group alive, and gloo
    del trainer; gc.collect()                  # can abort at interpreter exit; DDP's reducer first, or the
    torch.distributed.destroy_process_group()  # group can hang at exit (examples/hf_trainer.py says why)
    raise SystemExit(exit_code)

Each optimizer step of the Trainer is one ``Guard.step``: the Trainer's own forward and backward
(``training_step``, DDP or FSDP2 through accelerate) is the closure, and the guard measures, decides
skip / abort, clips (``TrainingArguments.max_grad_norm`` is its ``optim.grad_clip``), steps the
optimizer and the LR schedule and saves by its policy. The Trainer's own clipping, ``optimizer.step()``
and ``lr_scheduler.step()`` that follow are no-ops (the guard already decided). What the Trainer logs
is what a plain ``Trainer`` logs for the same steps: each rank's loss, the true global norm before
clipping as ``grad_norm``, the learning rate the step used, plus ``skipped`` (the count of steps since
the previous log whose update the guard dropped) when there were any.

Resume goes through trainguard and the Trainer's own resume path: before the first batch, the guard
restores the newest verified healthy checkpoint of ``RUN_DIR/checkpoints`` (model, optimizer,
schedule, every RNG, guard state and the Trainer's ``TrainerState``), and the Trainer continues at its
step as after ``resume_from_checkpoint``: it skips the batches already trained on by index
(accelerate's ``skip_first_batches``) and puts the RNGs back after drawing the first batch.

Limits, each refused at construction: ``gradient_accumulation_steps=1`` (the guard runs the closure
once per step, twice on an SDC rerun); ``max_steps`` set; not fp16 with loss scaling (the guard
measures the gradients as they are; bf16 or fp32); not ``load_best_model_at_end`` (it needs the
Trainer's own checkpoints); not rollback mode (``guards.check_for_global_norm``). The
Trainer's own checkpoints are turned off (``save_strategy`` becomes "no", with one logged line):
checkpoints are trainguard's, with ``huggingface/`` from ``model.config``.

Live mode (``fault_tolerance.live: true``, the ranks started by ``trainguard run --nproc N --config F --
python SCRIPT``): each rank is one process of accelerate's own (no DDP: the live engine sums the
gradients), ``training_step`` is one ``guard.step(loss_of)`` whose micro-batches the adapter draws from
the Trainer's data by position (``hf_micro_batches``), the Trainer's loop iterates one empty batch per
step, rank 0 of the live run logs, and ``train()`` ends the process with the live run's exit code. The
``TrainerState`` rides in the live run's checkpoints and in a replacement's state as in the closure mode.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy

from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state
from trainguard.config.load import load_config
from trainguard.config.schema import OptimConfig, RunConfig
from trainguard.integrations.hf_micro_batches import TrainerMicroBatches, epoch_after
from trainguard.step.guard import Guard, StepOutcome
from trainguard.step.live import with_launcher_overrides

log = logging.getLogger(__name__)


class SteppedByGuard:
    """The Trainer's optimizer or LR scheduler after the guard took them over: ``step()`` is a no-op
    (``Guard.step`` stepped it already, or decided not to); everything else is the real one's."""

    def __init__(self, inner: Any):
        self.inner = inner

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _unwrapped(thing: Any, attribute: str) -> Any:
    """The torch object inside accelerate's wrapper: ``AcceleratedOptimizer.optimizer`` (the wrapper
    skips ``Optimizer.__init__``, so it takes no step hooks, which async saves register), and
    ``AcceleratedScheduler.scheduler`` (the wrapper steps once per process: the guard steps it once)."""
    return getattr(thing, attribute, thing)


class CheckpointedTrainerState:
    """The Trainer's ``TrainerState`` (log history, epoch, best metric, tokens seen, stateful callbacks)
    in every trainguard checkpoint, as ``trainer_state.json`` is in the Trainer's own. The guard saves
    inside the Trainer's step, before the Trainer counts that step and logs it: what is saved is the
    state after the previous step (its log history, flops and tokens seen lack the saved step's); the
    step and epoch of the checkpoint are set when it is restored."""

    def __init__(self, trainer: "GuardedTrainer"):
        self.trainer = trainer
        self.loaded: TrainerState | None = None

    def state_dict(self) -> dict[str, str]:
        trainer = self.trainer
        exportable = [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
                      if isinstance(cb, ExportableState)]
        state = dataclasses.replace(trainer.state, stateful_callbacks=exportable)  # their state now
        return {"json": json.dumps(dataclasses.asdict(state), sort_keys=True)}

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.loaded = TrainerState(**json.loads(state["json"]))


# the Trainer's total, as live mode's line names it when it is not the launcher's train.steps
MAX_STEPS_NAMED = "GuardedTrainer: TrainingArguments(max_steps={})"


class _StopWhenGuardSays(TrainerCallback):
    """After each step (the Trainer has counted it), asks the guard whether the run ends here: the
    schedule's end, the kill switch, SIGTERM/SIGUSR1 or the time limit (saved before it answers)."""

    def __init__(self, trainer: "GuardedTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        micro_batches = self.trainer.micro_batches
        if micro_batches is not None:  # live: the step's M*b positions, not the loop's one empty batch
            state.epoch = micro_batches.epoch(state.global_step)
        if self.trainer.guard.should_stop(state.global_step, state.max_steps, total_named=MAX_STEPS_NAMED):
            control.should_training_stop = True
        return control


class GuardedTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer steps, saves and resume go through ``trainguard.Guard``.

    ``guard_config``: a ``trainguard.yaml`` path or a ``trainguard.Config`` (the keys of ``trainguard
    train``: ``guards.*``, ``checkpoint.*``, ``lifecycle.*``). Every other argument is the Trainer's.
    """

    def __init__(self, run_dir: str | Path, *args: Any, guard_config: str | Path | RunConfig | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = guard_config if isinstance(guard_config, RunConfig) else load_config(guard_config)
        # and the live launcher's --set items, which Guard applies too: the adapter runs the ranks' mode
        config = with_launcher_overrides(config, os.environ)
        refuse_unsupported(self.args, config)
        if self.args.fsdp and not (self.is_fsdp_enabled or self.is_fsdp_xla_enabled):
            raise ValueError(f"GuardedTrainer: TrainingArguments(fsdp=...) but accelerate runs "
                             f"{self.accelerator.distributed_type.value}, not FSDP: it turns FSDP on only on "
                             "accelerators (with use_cpu=True the Trainer would silently run DDP); "
                             "give each rank a GPU, or leave fsdp unset")
        self.micro_batches: TrainerMicroBatches | None = None
        """Live mode: the micro-batches of each step, by position, from the Trainer's data."""
        if config.fault_tolerance.live:
            refuse_unsupported_live(self)
            self.micro_batches = TrainerMicroBatches(self, config.train.micro_batches)
        config.optim.grad_clip = self.args.max_grad_norm or 0.0  # the guard clips, by the true global norm
        if self.args.save_strategy != SaveStrategy.NO:
            log.warning("GuardedTrainer: save_strategy=%r set to 'no': checkpoints are trainguard's "
                        "(checkpoint.save_interval)", self.args.save_strategy.value)
            self.args.save_strategy = SaveStrategy.NO
        self.run_dir = Path(run_dir)
        self.guard_config = config
        self.guard: Guard | None = None
        self.exit_code: int | None = None
        """After ``train()``: 0, or 16 after a signal or time-limit stop. Pass it to ``SystemExit``."""
        self._checkpointed_state = CheckpointedTrainerState(self)
        self._train_loader: Any = None
        self._prepared: tuple[Any, Any] | None = None
        self._resumed_from: str | None = None  # the Trainer's resume_from_checkpoint, for its data skip
        self._resumed_rng: dict[str, Any] | None = None
        self._stopped_at_start = False
        self._outcome: StepOutcome | None = None
        self._step_lr: float | None = None
        self._skipped_since_log = 0
        self._joined_after: int | None = None  # live: the step this process joined at, for its first log
        self.add_callback(_StopWhenGuardSays(self))

    def train(self, *args: Any, **kwargs: Any):
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise ValueError("GuardedTrainer resumes from RUN_DIR/checkpoints by itself; "
                             "do not pass resume_from_checkpoint")
        result = super().train(*args, **kwargs)
        self.exit_code = self.guard.close()  # waits for the last commit
        return result

    # The Trainer's resume, fed from the guard: the Trainer prepares model, optimizer and scheduler
    # right after it sets up its state; both happen here so that the guard restores the checkpoint
    # before the Trainer decides from which epoch and batch it continues.
    def get_train_dataloader(self):
        if self.micro_batches is not None:
            self._train_loader = self.micro_batches.step_loader()
        else:
            self._train_loader = super().get_train_dataloader()
        return self._train_loader

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        self._prepared = super()._prepare_for_training(max_steps, self._train_loader, None)
        step = self._start_guard()
        if self.micro_batches is not None:  # the live run's rank is known now: its rank 0 logs
            self.state.is_local_process_zero = self.is_local_process_zero()
            self.state.is_world_process_zero = self.is_world_process_zero()
        if not step:
            return 0, 0
        loaded = self._checkpointed_state.loaded
        if loaded is not None:
            self.state = loaded
            self._load_callback_state()
        self.state.global_step = step
        self.state.epoch = (self.micro_batches.epoch(step) if self.micro_batches is not None
                            else epoch_after(step, num_update_steps_per_epoch))
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return divmod(step, num_update_steps_per_epoch)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        prepared, self._prepared = self._prepared, None
        return prepared

    def _start_guard(self) -> int:
        """Builds the guard on the prepared model, optimizer and scheduler, resumes, and returns the step."""
        model = self.model  # unwrapped: FSDP2 shards it in place, DDP wraps it in model_wrapped
        live = self.micro_batches is not None
        # live mode too: the TrainerState rides in durable checkpoints and in the state a replacement receives
        # (the lowest live rank's). The Trainer counts, logs and runs its callbacks after training_step returns,
        # so the state is settled before the next guard.step; every live rank logs the same global loss, norm
        # and rate, so every rank holds the same log history (is_*_process_zero are set again after a load).
        self.guard = Guard(self.run_dir, model, _unwrapped(self.optimizer, "optimizer"),
                           scheduler=_unwrapped(self.lr_scheduler, "scheduler"),
                           stateful={"trainer_state": self._checkpointed_state},
                           config=self.guard_config, hf_config=getattr(model, "config", None),
                           tokenizer=self.processing_class)
        step = self.guard.resume()  # live: 0, the launcher's checkpoint's step, or the step a replacement joined at
        self._joined_after = self.guard.joined_at
        self._resumed_rng = capture_rng_state()
        if step:  # the Trainer's loop skips the steps before it (live: empty batches)
            resumed = None if live else self.guard.checkpoints.resumed_from
            self._resumed_from = resumed or str(self.run_dir / "checkpoints")
        self._stopped_at_start = self.guard.should_stop(step, self.args.max_steps, total_named=MAX_STEPS_NAMED)
        self.optimizer = SteppedByGuard(self.optimizer)
        self.lr_scheduler = SteppedByGuard(self.lr_scheduler)
        return step

    def _run_epoch(self, **kwargs: Any) -> None:
        if self._stopped_at_start:  # the kill switch, or a stop asked for before the first step
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(**{**kwargs, "resume_from_checkpoint": self._resumed_from})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # the Trainer puts the RNGs back after the iterator of the resumed epoch drew from them
        if checkpoint is not None:
            restore_rng_state(self._resumed_rng)

    # The step.
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        if self.micro_batches is not None:
            return self._live_training_step(model)
        self._step_lr = super()._get_learning_rate()  # the rate this step uses: the guard steps the schedule
        losses: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            losses.append(super(GuardedTrainer, self).training_step(model, inputs, num_items_in_batch))
            return losses[-1]

        self._outcome = self.guard.step(closure)
        if self._outcome.rolled_back:
            raise RuntimeError(
                f"GuardedTrainer: the guard restored global_step_{self._outcome.step} (state that changed at rest, "
                "see the fingerprint_recompute event); the Trainer cannot rewind its data loader in place, so this "
                "process ends and a restart (trainguard run) recomputes from that checkpoint")
        self._skipped_since_log += self._outcome.skipped
        return losses[-1]  # this rank's loss, which the Trainer averages over ranks as it always does

    def _live_training_step(self, model: torch.nn.Module) -> torch.Tensor:
        """One committed step of the live run, through any recovery; its loss is the mean over the global
        batch, which every rank logs alike (the Trainer does not average it again: one process each)."""
        model.train()
        # the rate this step uses: the live engine steps the scheduler after each applied update, as the closure
        # mode does, so after the call the optimizer holds the next step's
        self._step_lr = self.optimizer.param_groups[0]["lr"]
        self._outcome = self.guard.step(self.micro_batches.loss_of, self.micro_batches.sample_range)
        self._skipped_since_log += self._outcome.skipped
        return torch.tensor(self._outcome.loss, device=self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # the guard clipped, by the true global norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float:
        return self._outcome.global_norm  # before clipping, as a plain Trainer logs it

    def _get_learning_rate(self) -> float:
        return self._step_lr if self._step_lr is not None else super()._get_learning_rate()

    def get_total_train_batch_size(self, args: Any) -> int:
        if self.micro_batches is not None:  # live: the global batch, M micro-batches of b, whatever the ranks
            return self.micro_batches.micro_batches * self.micro_batches.size
        return super().get_total_train_batch_size(args)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        if self.micro_batches is not None:
            return 0  # live: the loop's batches are empty; the live engine draws the samples (not counted)
        return super().floating_point_ops(inputs)

    # Live mode: every rank is one process of accelerate's own (not distributed); rank 0 of the live run
    # (a replacement of it too) logs, shows the progress and is the state's "world process zero".
    def is_world_process_zero(self) -> bool:
        if getattr(self, "micro_batches", None) is not None and getattr(self, "guard", None) is not None:
            return self.guard.rank == 0
        return super().is_world_process_zero()

    def is_local_process_zero(self) -> bool:
        if getattr(self, "micro_batches", None) is not None and getattr(self, "guard", None) is not None:
            return self.guard.rank == 0
        return super().is_local_process_zero()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._skipped_since_log:
            logs["skipped"] = self._skipped_since_log
            self._skipped_since_log = 0
        if "loss" in logs and self._joined_after is not None:
            # a live replacement received its TrainerState inside that step, before the Trainer logged it:
            # its log goes on from the next step, and its first entry names the step it lacks
            logs["joined_after_step"] = self._joined_after
            self._joined_after = None
        super().log(logs, start_time)


def refuse_unsupported(args: Any, config: RunConfig) -> None:
    """One ``ValueError`` line for the first setting the adapter cannot honour, naming it."""
    if args.gradient_accumulation_steps != 1:
        raise ValueError("GuardedTrainer: gradient_accumulation_steps must be 1 (one guarded step per batch), "
                          f"got {args.gradient_accumulation_steps}")
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError("GuardedTrainer: set TrainingArguments(max_steps=N); the guard's schedule counts steps")
    if args.fp16:
        raise ValueError("GuardedTrainer: fp16=True is not supported (the guard measures and clips the gradients "
                          "as they are, not loss-scaled); use bf16=True or fp32")
    if args.load_best_model_at_end:
        raise ValueError("GuardedTrainer: load_best_model_at_end=True needs the Trainer's own checkpoints; "
                          "checkpoints are trainguard's (trainguard ckpt list / merge)")
    if config.optim.grad_clip not in (OptimConfig().grad_clip, args.max_grad_norm):
        raise ValueError(f"GuardedTrainer: optim.grad_clip={config.optim.grad_clip} in the guard config and "
                          f"TrainingArguments.max_grad_norm={args.max_grad_norm} disagree; set max_grad_norm only")
    if config.guards.check_for_global_norm:
        raise ValueError("GuardedTrainer: rollback mode (guards.check_for_global_norm) needs a data source "
                          "that can skip ranges; use data skip (guards.skip) instead")


def refuse_unsupported_live(trainer: Trainer) -> None:
    """Live mode's own refusals, one ``ValueError`` line each: what the position-indexed micro-batches
    (``hf_micro_batches``) and the live engine's reduction cannot take."""
    args = trainer.args
    if trainer.accelerator.distributed_type != DistributedType.NO:
        raise ValueError(f"GuardedTrainer: fault_tolerance.live with the Trainer distributed by accelerate "
                          f"({trainer.accelerator.distributed_type.value}): the live engine sums the ranks' "
                          "gradients itself; start the ranks with trainguard run --nproc N --config FILE -- "
                          "python SCRIPT, not torchrun")
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError("GuardedTrainer: fault_tolerance.live needs a train_dataset with a length, indexed by "
                          "position (any rank computes any micro-batch of a step), not an iterable one")
    if args.train_sampling_strategy != "random":
        raise ValueError(f"GuardedTrainer: train_sampling_strategy={args.train_sampling_strategy!r} with "
                          "fault_tolerance.live: live mode draws each micro-batch by position from the seeded "
                          "random order (the default, 'random')")
    if args.include_num_input_tokens_seen != "no":
        raise ValueError(f"GuardedTrainer: include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} "
                          "with fault_tolerance.live: the live engine draws the samples, the Trainer's loop "
                          "does not see them to count their tokens")
