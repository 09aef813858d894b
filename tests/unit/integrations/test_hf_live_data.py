"""``GuardedTrainer`` in live mode, by configuration alone (``fault_tolerance.live: true``, in its config
or from the live launcher's ``--set``): its micro-batches are the plain ``Trainer``'s batches, taken by
position (micro-batch ``m`` of step ``t`` is batch ``t*M + m`` of a plain ``Trainer`` in one process,
across epochs), its loop iterates one empty batch per step, and what live mode cannot take is refused in
one line. The live run itself: tests/integration/test_live_hf_trainer.py."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

from transformers import Trainer, TrainingArguments  # noqa: E402

from trainguard.config import load_config  # noqa: E402
from trainguard.integrations.hf_trainer import GuardedTrainer  # noqa: E402
from trainguard.step.live import LAUNCHER_OVERRIDES_ENV  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer.py"
spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

SIZE, BATCH, MICRO_BATCHES = 24, 2, 4  # 3 steps per pass over the data


def arguments(tmp_path: Path, **extra) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=8, per_device_train_batch_size=BATCH,
                             report_to=[], use_cpu=True, save_strategy="no", seed=3, **extra)


def live_trainer(tmp_path: Path, overrides=("fault_tolerance.live=true",), dataset=None, **extra) -> GuardedTrainer:
    config = load_config(None, [*overrides, f"train.micro_batches={MICRO_BATCHES}"])
    return GuardedTrainer(tmp_path / "run", guard_config=config, model=example.tiny_qwen2(),
                          args=arguments(tmp_path, **extra),
                          train_dataset=example.ArithmeticSequences(SIZE) if dataset is None else dataset)


def test_live_mode_is_taken_from_the_config_alone(tmp_path):
    trainer = live_trainer(tmp_path)
    assert trainer.micro_batches is not None
    assert len(trainer.get_train_dataloader()) == math.ceil(SIZE / (MICRO_BATCHES * BATCH))
    assert next(iter(trainer.get_train_dataloader())) == {}  # the live engine draws the step's samples
    assert trainer.get_total_train_batch_size(trainer.args) == MICRO_BATCHES * BATCH
    assert not (tmp_path / "run").exists()  # nothing starts before train()


def test_the_live_launchers_set_items_switch_the_adapter_too(tmp_path, monkeypatch):
    """``trainguard run --nproc N --set fault_tolerance.live=true ...``: the ranks' ``Guard`` applies the item
    from the environment; the adapter sees it as well, or it would hand the guard closure-mode arguments."""
    monkeypatch.setenv(LAUNCHER_OVERRIDES_ENV, json.dumps(["fault_tolerance.live=true"]))
    assert live_trainer(tmp_path, overrides=()).micro_batches is not None
    monkeypatch.delenv(LAUNCHER_OVERRIDES_ENV)
    assert live_trainer(tmp_path, overrides=()).micro_batches is None


@pytest.mark.parametrize("data_seed", [None, 11])
def test_micro_batches_are_a_plain_trainers_batches_by_position(tmp_path, data_seed):
    """A plain ``Trainer`` in one process with ``gradient_accumulation_steps=M`` takes, for optimizer step
    ``t``, its batches ``t*M .. t*M + M-1``: the live adapter's micro-batches 0..M-1 of step ``t``, sample
    for sample, across three passes over the data (steps that start in one pass and end in the next)."""
    live = live_trainer(tmp_path, data_seed=data_seed).micro_batches
    plain = Trainer(model=example.tiny_qwen2(), train_dataset=example.ArithmeticSequences(SIZE),
                    args=arguments(tmp_path, data_seed=data_seed, gradient_accumulation_steps=MICRO_BATCHES))
    loader = plain.get_train_dataloader()
    batches = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        batches.extend(loader)
    steps = len(batches) // MICRO_BATCHES
    assert steps == 3 * SIZE // (MICRO_BATCHES * BATCH)
    for step in range(steps):
        for micro_batch in range(MICRO_BATCHES):
            ours = live.collator([live.dataset[i] for i in live.indices(step, micro_batch)])
            theirs = batches[step * MICRO_BATCHES + micro_batch]
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[key], theirs[key]) for key in ours), (step, micro_batch)


def test_the_epoch_after_a_step_is_the_plain_trainers(tmp_path):
    """The plain ``Trainer`` (``gradient_accumulation_steps=M``, one batch of ``b`` per micro-batch) logs
    ``epoch + batches_in_epoch / batches_per_epoch`` after each step; the live adapter the same float."""
    live = live_trainer(tmp_path).micro_batches
    batches_per_epoch = SIZE // BATCH
    for step in range(1, 10):
        epoch, within = divmod(step * MICRO_BATCHES - 1, batches_per_epoch)
        assert live.epoch(step) == epoch + (within + 1) / batches_per_epoch, step


def test_the_loss_of_a_micro_batch_is_the_trainers_compute_loss(tmp_path):
    trainer = live_trainer(tmp_path)
    live = trainer.micro_batches
    inputs = live.collator([live.dataset[i] for i in live.indices(2, 1)])
    trainer.model.eval()  # no dropout: the same forward twice
    with torch.no_grad():
        assert torch.equal(live.loss_of(trainer.model, 2, 1), trainer.compute_loss(trainer.model, inputs))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(example.ArithmeticSequences(SIZE))


@pytest.mark.parametrize(("dataset", "extra", "message"), [
    (Stream(), {}, r"^GuardedTrainer: fault_tolerance.live needs a train_dataset with a length"),
    (None, {"train_sampling_strategy": "sequential"},
     r"^GuardedTrainer: train_sampling_strategy='sequential' with fault_tolerance.live"),
    (None, {"include_num_input_tokens_seen": True},
     r"^GuardedTrainer: include_num_input_tokens_seen='all' with fault_tolerance.live"),
    (None, {"gradient_accumulation_steps": 2}, r"^GuardedTrainer: gradient_accumulation_steps must be 1"),
])
def test_what_live_mode_cannot_take_is_refused_in_one_line(tmp_path, dataset, extra, message):
    with pytest.raises(ValueError, match=message) as refused:
        live_trainer(tmp_path, dataset=dataset, **extra)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()
