"""The micro-batches of a live ``GuardedTrainer`` (``fault_tolerance.live: true``), drawn from the
Trainer's own data by position, so that any rank can compute any micro-batch.

The global batch of a step is ``train.micro_batches`` (``M``) micro-batches of
``per_device_train_batch_size`` (``b``) samples, whatever the number of live ranks. Micro-batch ``m``
of step ``t`` (from 0) holds the samples at positions ``[(t*M + m)*b, (t*M + m + 1)*b)`` of the seeded
order the Trainer itself samples in: epoch ``e`` is ``randperm(len(dataset))`` seeded with
``data_seed`` (or ``seed``) ``+ e`` (accelerate's ``SeedableRandomSampler``, the Trainer's default
sampler; ``trainer.data.StatefulSampler`` computes it), epochs chained. A plain ``Trainer`` in one
process with ``gradient_accumulation_steps=M`` takes the same samples for the same step. Each
micro-batch goes through the Trainer's own collator (its unused columns removed as the Trainer's loader
removes them), ``_prepare_inputs`` and ``compute_loss``: the loss of one micro-batch, which the live
engine scales by ``1/M`` and sums over the quorum in a fixed order.

The Trainer's loop still runs (callbacks, logging, the stop check), over a loader that yields one empty
batch per step and draws nothing (``step_loader``): the live engine computes the step's micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from trainguard.trainer.data import StatefulSampler


def epoch_after(step: int, steps_in_epoch: int) -> float:
    """``TrainerState.epoch`` after optimizer step ``step`` (one batch per step), as the Trainer computes it."""
    epoch, index = divmod(step - 1, steps_in_epoch)
    return epoch + (index + 1) / steps_in_epoch


class TrainerMicroBatches:
    """Micro-batch ``m`` of step ``t`` of a ``Trainer``'s training set, by position (see the module)."""

    def __init__(self, trainer: Any, micro_batches: int):
        args = trainer.args
        self.trainer = trainer
        self.micro_batches = micro_batches
        self.size = args.per_device_train_batch_size
        dataset = trainer.train_dataset
        collator = trainer.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):  # as Trainer._get_dataloader does
            dataset = trainer._remove_unused_columns(dataset, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
        self.dataset, self.collator = dataset, collator
        seed = args.data_seed if args.data_seed is not None else args.seed
        self.order = StatefulSampler(len(dataset), dp_rank=0, dp_size=1, micro_batch_size=self.size, seed=seed)

    def sample_range(self, step: int, micro_batch: int) -> tuple[int, int]:
        """The positions ``[first, end)`` of micro-batch ``micro_batch`` of step ``step`` (from 0)."""
        first = (step * self.micro_batches + micro_batch) * self.size
        return first, first + self.size

    def indices(self, step: int, micro_batch: int) -> list[int]:
        """The data set's indices of micro-batch ``micro_batch`` of step ``step``."""
        first, end = self.sample_range(step, micro_batch)
        return self.order.peek_global_indices(first, end - first)

    def loss_of(self, model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        """The Trainer's loss of one micro-batch (its mean over the micro-batch, as ``compute_loss`` gives it)."""
        trainer = self.trainer
        inputs = trainer._prepare_inputs(self.collator([self.dataset[i] for i in self.indices(step, micro_batch)]))
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, inputs)

    def epoch(self, steps: int) -> float:
        """``TrainerState.epoch`` after ``steps`` steps: the positions consumed over the data set's size,
        rounded as the Trainer rounds its own (a plain ``Trainer`` with ``gradient_accumulation_steps=M``
        logs the same value when the size is a multiple of ``M*b``)."""
        return epoch_after(steps * self.micro_batches * self.size, len(self.dataset))

    def steps_per_epoch(self) -> int:
        """The steps of one pass over the data set (the last one may reach into the next pass)."""
        global_batch = self.micro_batches * self.size
        return max(1, -(-len(self.dataset) // global_batch))

    def step_loader(self) -> DataLoader:
        """What the Trainer's loop iterates in live mode: one empty batch per step of an epoch."""
        return DataLoader(range(self.steps_per_epoch()), batch_size=1, collate_fn=no_inputs)


def no_inputs(batch: list[int]) -> dict[str, Any]:
    """A step's batch for the Trainer's loop: nothing (the live engine draws the step's micro-batches)."""
    return {}
