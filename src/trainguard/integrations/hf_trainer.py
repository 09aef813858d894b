"""trainguard in a Hugging Face ``transformers.Trainer``: ``GuardedTrainer``.

::

    trainer = GuardedTrainer(run_dir, model=model, args=TrainingArguments(..., max_steps=1000),
                             train_dataset=dataset, guard_config="trainguard.yaml")
    trainer.train()
    torch.distributed.destroy_process_group()  # the Trainer leaves it alive; gloo can abort at interpreter exit
    raise SystemExit(trainer.exit_code)       # 0, 16 after a signal / time-limit stop: the supervisor's cue

Each optimizer step of the Trainer is one ``Guard.step``: the Trainer's own forward and backward
(``training_step``, DDP or FSDP2 through accelerate) is the closure, and the guard measures, decides
skip / abort, clips, steps the optimizer and the LR schedule and saves by its policy. The Trainer's
own ``optimizer.step()`` and ``lr_scheduler.step()`` that follow are no-ops (the guard already decided),
and its clipping is off (``max_grad_norm`` becomes the guard's ``optim.grad_clip``).

Resume goes through trainguard: when training begins, the guard restores the newest verified healthy
checkpoint of ``RUN_DIR/checkpoints`` (model, optimizer, schedule, every RNG, guard state) and the
Trainer continues at its step, its data loader fast-forwarded past the batches already trained on.
Checkpoints are trainguard's (``global_step_N/`` with ``huggingface/`` from ``model.config``, so
``trainguard ckpt merge`` needs nothing else); leave the Trainer's own ``save_strategy="no"``.

Limits: one batch per optimizer step (``gradient_accumulation_steps=1``: the guard runs the closure
once per step, twice on an SDC rerun); ``max_steps`` set; bf16 or fp32, not fp16 with loss scaling (the
guard measures the gradients as they are); data skip, health and SDC guards as configured, not
rollback mode (``check_for_global_norm``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state
from trainguard.config.load import load_config
from trainguard.config.schema import RunConfig
from trainguard.step.guard import Guard


class BatchPosition:
    """How many batches the run has trained on (one per optimizer step): the data state a checkpoint keeps."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = int(state["batches"])


class ResumedLoader:
    """The Trainer's data loader, fast-forwarded to a resumed position on its first pass: whole epochs
    skipped by epoch number (the sampler's order depends on the epoch only), then the batches of the
    current epoch drawn and dropped. Creating that first iterator draws from the RNGs, which the
    uninterrupted run did before the checkpoint's RNG state was taken: they are put back afterwards."""

    def __init__(self, loader: Any, position: BatchPosition):
        self.loader, self.position = loader, position
        self.skip: int | None = None  # batches to fast-forward on the next pass; set when the guard resumes
        self.epoch_offset = 0

    def resume_at(self, batches: int) -> None:
        per_epoch = len(self.loader)
        self.epoch_offset, self.skip = divmod(batches, per_epoch)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch + self.epoch_offset)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if not self.skip:
            yield from self.loader
            return
        skip, self.skip = self.skip, None
        rng = capture_rng_state()
        iterator = iter(self.loader)
        for _ in range(skip):
            next(iterator)
        restore_rng_state(rng)
        yield from iterator


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
    """accelerate's ``AcceleratedScheduler`` holds the torch scheduler in an attribute (and steps it once
    per process: the guard steps the torch one, once)."""
    return getattr(thing, attribute, thing)


class _StartGuard(TrainerCallback):
    """Builds and resumes the guard once the Trainer has prepared model, optimizer and scheduler, before
    the first batch is drawn."""

    def __init__(self, trainer: "GuardedTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        state.global_step = self.trainer.start_guard()
        return control


class GuardedTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer steps, saves and resume go through ``trainguard.Guard``.

    ``guard_config``: a ``trainguard.yaml`` path or a ``trainguard.Config`` (the keys of ``trainguard
    train``: ``guards.*``, ``checkpoint.*``, ``lifecycle.*``). Every other argument is the Trainer's.
    """

    def __init__(self, run_dir: str | Path, *args: Any, guard_config: str | Path | RunConfig | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("GuardedTrainer: gradient_accumulation_steps must be 1 (one guarded step per batch), "
                             f"got {self.args.gradient_accumulation_steps}")
        if self.args.max_steps is None or self.args.max_steps <= 0:
            raise ValueError("GuardedTrainer: set TrainingArguments(max_steps=N); the guard's schedule counts steps")
        self.run_dir = Path(run_dir)
        config = guard_config if isinstance(guard_config, RunConfig) else load_config(guard_config)
        if config.fault_tolerance.live:
            raise ValueError("GuardedTrainer: fault_tolerance.live is not supported (live recovery needs the loss of "
                             "each micro-batch and carries no LR scheduler); use trainguard.Guard in live mode in "
                             "your own loop (docs/live_recovery.md)")
        if config.guards.check_for_global_norm:
            raise ValueError("GuardedTrainer: rollback mode (guards.check_for_global_norm) needs a data source "
                             "that can skip ranges; use data skip (guards.skip) instead")
        config.optim.grad_clip = self.args.max_grad_norm or 0.0  # the guard clips, by the true global norm
        self.args.max_grad_norm = 0.0
        self.guard_config = config
        self.position = BatchPosition()
        self.guard: Guard | None = None
        self.exit_code: int | None = None
        """After ``train()``: 0, or 16 after a signal or time-limit stop. Pass it to ``SystemExit``."""
        self._loader: ResumedLoader | None = None
        self.add_callback(_StartGuard(self))

    def get_train_dataloader(self) -> ResumedLoader:
        self._loader = ResumedLoader(super().get_train_dataloader(), self.position)
        return self._loader

    def start_guard(self) -> int:
        """Builds the guard on the prepared model, optimizer and scheduler, resumes, and returns the step."""
        model = self.model  # unwrapped: FSDP2 shards it in place, DDP wraps it in model_wrapped
        # accelerate's optimizer wrapper stays: its step() knows the gradient-sync state and loss scaling
        self.guard = Guard(self.run_dir, model, self.optimizer,
                           scheduler=_unwrapped(self.lr_scheduler, "scheduler"), stateful={"data": self.position},
                           config=self.guard_config, hf_config=getattr(model, "config", None),
                           tokenizer=self.processing_class)
        step = self.guard.resume()
        if self._loader is not None and self.position.batches:
            self._loader.resume_at(self.position.batches)
        self.optimizer = SteppedByGuard(self.optimizer)
        self.lr_scheduler = SteppedByGuard(self.lr_scheduler)
        return step

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        guard = self.guard
        if guard.should_stop(guard.global_step, self.state.max_steps):
            self.control.should_training_stop = True
            return torch.zeros((), device=self.args.device)

        def closure() -> torch.Tensor:
            # counted inside: the guard saves after the step, and restores the count for an SDC rerun
            self.position.batches += 1
            return super(GuardedTrainer, self).training_step(model, inputs, num_items_in_batch)

        outcome = guard.step(closure)
        loss = outcome.loss if math.isfinite(outcome.loss) else 0.0
        return torch.tensor(loss, device=self.args.device)

    def train(self, *args: Any, **kwargs: Any):
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise ValueError("GuardedTrainer resumes from RUN_DIR/checkpoints by itself; "
                             "do not pass resume_from_checkpoint")
        result = super().train(*args, **kwargs)
        self.exit_code = self.guard.close()  # waits for the last commit
        return result
