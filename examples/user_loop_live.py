r"""A user's own model, optimizer and data trained with live recovery (``trainguard.Guard`` in live mode).

Each rank builds the model and optimizer (seeded: every rank starts alike) and hands them to
``trainguard.Guard`` with a config that says ``fault_tolerance.live: true`` (``user_loop_live.yaml``),
then loops over ``guard.steps(loss_of)`` with the loss of one micro-batch by index; the library does the
rest: per-micro-batch backward, the order-fixed gradient sum over the ranks alive, the optimizer step,
the quorum changes and the rejoin of a replaced rank. The model has dropout: each micro-batch's mask is
drawn from (``train.seed``, step, micro-batch), so whichever rank computes it draws the same one. ``trainguard run`` starts this script as the ranks
of the live run the config describes (4 gloo ranks: 2 replica groups x 2); here its drill SIGKILLs
rank 3 once it has committed 5 steps (``faults``: ``kill:rank=3,step=5``) and a warm spare
(``fault_tolerance.spares=1``) takes its place:

    PYTHONPATH=src python -m trainguard run --nproc 4 --config examples/user_loop_live.yaml --run-dir runs/live \
        --set fault_tolerance.spares=1 --set 'faults=kill:rank=3,step=5' -- python examples/user_loop_live.py

A rank is this script with the launcher's flags (``--store ... --rank R --run-dir DIR ...``: they decide
its place, the steps and the global batch) and its own (``--config``, ``--lr``).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import trainguard

CLASSES, FEATURES, MICRO_BATCH = 4, 12, 8
CONFIG = Path(__file__).with_suffix(".yaml")


def sample_range(step: int, micro_batch: int, micro_batches: int) -> tuple[int, int]:
    first = (step * micro_batches + micro_batch) * MICRO_BATCH
    return first, first + MICRO_BATCH


def batch(step: int, micro_batch: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one micro-batch, a pure function of its index: the data position is the step."""
    first, _ = sample_range(step, micro_batch, micro_batches)
    generator = torch.Generator().manual_seed(first)
    inputs = torch.randn(MICRO_BATCH, FEATURES, generator=generator)
    return inputs, (inputs[:, :CLASSES].argmax(dim=1) + (inputs[:, -1] > 1).long()) % CLASSES


def build_model() -> torch.nn.Module:
    """Seeded: every rank starts alike."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 24), torch.nn.GELU(), torch.nn.LayerNorm(24),
                               torch.nn.Dropout(0.1), torch.nn.Linear(24, CLASSES))


def rank_main(argv: list[str]) -> None:
    model = build_model()
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--run-dir", type=Path, required=True)  # the launcher's flag: the run's directory
    own, _ = parser.parse_known_args(argv)  # the rest are the launcher's flags, the guard's
    optimizer = torch.optim.AdamW(model.parameters(), lr=own.lr, weight_decay=0.1)
    guard = trainguard.Guard(own.run_dir, model, optimizer, config=own.config)  # live: the config says so

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        inputs, labels = batch(step, micro_batch, guard.micro_batches)
        return F.cross_entropy(model(inputs), labels)

    def samples_of(step: int, micro_batch: int) -> tuple[int, int]:  # for the events' sample check
        return sample_range(step, micro_batch, guard.micro_batches)

    for step in guard.steps(loss_of, samples_of):  # each step as it commits (a redone step comes again)
        if step % 10 == 0:
            model.eval()  # the printed loss without dropout: the body only observes
            with torch.no_grad():
                inputs, labels = batch(step, 0, guard.micro_batches)
                print(f"step {step} loss {F.cross_entropy(model(inputs), labels):.4f}", flush=True)
            model.train()
    guard.close()  # ends this process (exit 0)


if __name__ == "__main__":
    rank_main(sys.argv[1:])
