"""torchtitan's own ``Trainer`` (``torchtitan/train.py``, torchtitan 0.2.x) with its steps and checkpoints
on ``trainguard.Guard``.

``GuardedTrainer(job_config)`` is a ``torchtitan.train.Trainer``: torchtitan builds everything as usual
(device, meshes, the model of its ``TrainSpec`` and its parallelism, ``OptimizersContainer``,
``LRSchedulersContainer``, tokenizer, data loader, loss); its ``train()`` then runs each step through
``Guard.step`` instead of torchtitan's loop: torchtitan's forward and backward
(``forward_backward_step``: its AMP, its loss over the global count of valid tokens, gradient
accumulation) in the closure, and Guard's zero_grad, guards, clipping (``optim.grad_clip`` from
``training.max_norm``), optimizer and scheduler steps, checkpoint tiers, ``should_stop``/``close`` and
``resume``. Each checkpoint holds the model, the optimizer's and scheduler's whole state (through
``guard_components``), torchtitan's data loader state and the trainer's own (``step``,
``ntokens_seen``). torchtitan's checkpointer stays disabled.

::

    job_config = ConfigManager().parse_args([...])     # torchtitan's own flags
    trainer = GuardedTrainer(job_config, guard_overrides=["checkpoint.save_interval=2"])
    try:
        trainer.train()       # resumes from the newest checkpoint under job.dump_folder
    finally:
        trainer.close()
    raise SystemExit(trainer.exit_code)

Refused in one line (``ConfigError``): torchtitan's own checkpointing (``checkpoint.enable``), pipeline
parallel (Guard steps one model part), model converters (float8, ...: their hook runs after
torchtitan's optimizer step, which Guard bypasses), and what only torchtitan's own loop runs
(``LOOP_ONLY``: validation, profiling, memory snapshots, TensorBoard and W&B metrics). torchtitan 0.3's ``Trainer`` (``torchtitan.trainer``)
is a different class built from its ``Trainer.Config``: not covered here (docs/library.md says why).
``examples/torchtitan_trainer.py`` runs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torchtitan
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.train import Trainer

import trainguard
from trainguard.errors import ConfigError
from trainguard.integrations.torchtitan import guard_components

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

if not getattr(torchtitan, "__version__", "").startswith("0.2."):  # 0.3's Trainer is built from its Trainer.Config
    raise ImportError(f"trainguard.integrations.torchtitan_trainer needs torchtitan 0.2.x; this is "
                      f"{getattr(torchtitan, '__version__', 'unknown')}")


# torchtitan features that live in its train()/train_step(), not in what GuardedTrainer calls
LOOP_ONLY = ("validation.enable", "profiling.enable_profiling", "profiling.enable_memory_snapshot",
             "metrics.enable_tensorboard", "metrics.enable_wandb")


def refusals(job_config) -> list[str]:
    """What in a torchtitan ``JobConfig`` cannot run on Guard, one reason each."""
    reasons = []
    if job_config.checkpoint.enable:
        reasons.append("checkpoint.enable is true: Guard writes the checkpoints (leave it false)")
    if job_config.parallelism.pipeline_parallel_degree > 1:
        reasons.append("parallelism.pipeline_parallel_degree > 1: Guard steps one model part")
    if job_config.model.converters:
        reasons.append(f"model.converters {job_config.model.converters}: their post-optimizer hook runs in "
                       "torchtitan's optimizer step, which Guard does not call")
    loop_only = [key for key in LOOP_ONLY if getattr(getattr(job_config, key.split(".")[0]), key.split(".")[1])]
    if loop_only:
        reasons.append(f"{', '.join(loop_only)}: torchtitan's own loop runs these, which GuardedTrainer replaces "
                       "(its step lines and events.jsonl carry loss, gradient norm, learning rate and tokens/s)")
    return reasons


class GuardedTrainer(Trainer):
    """torchtitan's ``Trainer``, its loop and checkpoints on ``Guard`` (the module docstring).
    ``guard_config``: trainguard's guard.yaml (None: the defaults); ``guard_overrides``: its
    ``section.key=value`` settings, as ``--set`` takes them. The run directory is ``job.dump_folder``."""

    def __init__(self, job_config, *, guard_config: str | Path | None = None, guard_overrides: Sequence[str] = ()):
        reasons = refusals(job_config)
        if reasons:
            raise ConfigError("torchtitan Trainer on Guard: " + "; ".join(reasons))
        super().__init__(job_config)
        # torchtitan registers the model converters' hook on its container whether or not there are
        # converters; with none (refused above otherwise) it does nothing, and guard_components refuses
        # a container with hooks that stepping the optimizer inside it would skip
        self.optimizers._optimizer_step_post_hooks.clear()
        parts = guard_components(self.optimizers, self.lr_schedulers)
        training = job_config.training
        self.guard = trainguard.Guard(
            job_config.job.dump_folder, self.model_parts[0], parts.optimizer, scheduler=parts.scheduler,
            stateful={"dataloader": self.dataloader, "train_state": self}, config=guard_config,
            overrides=[f"optim.grad_clip={training.max_norm}", *guard_overrides],
            tokens_per_step=self.gradient_accumulation_steps * training.local_batch_size * self.batch_degree()
            * training.seq_len)
        self.exit_code: int | None = None

    def batch_degree(self) -> int:
        """Data-parallel ranks reading different batches."""
        return self.parallel_dims.get_mesh("batch").size() if self.parallel_dims.dp_enabled else 1

    def train(self) -> None:
        """Resumes, steps through ``Guard`` until it says stop, then closes it (``exit_code``)."""
        guard = self.guard
        self.step = guard.resume()
        data = self.batch_generator(self.dataloader)  # after resume: the data loader's state is restored
        while not guard.should_stop(self.step, self.job_config.training.steps, total_named="training.steps={}"):
            self.step += 1  # the step being trained: what a checkpoint saved inside guard.step holds
            self.gc_handler.run(self.step)
            self.step = guard.step(lambda: self.forward_backward(data)).step
        self.exit_code = guard.close()

    def forward_backward(self, data: Iterator[Batch]) -> torch.Tensor:
        """The forward and backward of torchtitan's ``train_step`` (gradient accumulation, the loss over
        the global count of valid tokens), without its clip and optimizer step, which Guard does.
        Returns this rank's share of the global mean loss times the data-parallel degree: Guard reports
        the mean of the ranks' values."""
        batches = [next(data) for _ in range(self.gradient_accumulation_steps)]
        tokens = torch.tensor(sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches),
                              dtype=torch.float32, device=self.device)
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(tokens, group=self.parallel_dims.get_mesh("batch").get_group())
        loss = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            inputs = {key: value.to(self.device) for key, value in inputs.items()}
            loss += self.forward_backward_step(input_dict=inputs, labels=labels.to(self.device),
                                               global_valid_tokens=tokens).detach()
        return loss * self.batch_degree()
