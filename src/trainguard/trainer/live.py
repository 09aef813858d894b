"""``python -m trainguard.trainer.live``: a rank of the reference trainer in live mode.

``trainguard train`` with ``fault_tolerance.live: true`` starts this module as every rank through the
live launcher (``cli/train.py``). Each rank builds the whole model (the same seed on every rank: no
FSDP/TP/PP shards, data-parallel only) and AdamW with its warmup and cosine schedule, and trains
through ``Guard`` in live mode, in the loop of both modes (``resume``, ``should_stop``, ``step(loss_of)``).
The data position is the step: micro-batch ``m`` of step ``t`` holds the
samples at global positions ``[(t*M + m)*B, (t*M + m + 1)*B)`` of the trainer's seeded order (``M =
train.micro_batches``, ``B = data.micro_batch_size``), so any rank can compute any micro-batch.
"""

from __future__ import annotations

import argparse
import sys

import torch

from trainguard.config import load_config
from trainguard.step.guard import Guard
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
from trainguard.trainer.model import build_model, build_model_config, token_cross_entropy
from trainguard.trainer.optim import build_optimizer


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m trainguard.trainer.live")
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", required=True)  # the launcher's
    own, _ = parser.parse_known_args(argv)  # the rest are the launcher's flags, the guard's
    config = load_config(own.config, own.overrides)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = build_model(build_model_config(config.model, max_position_embeddings=config.data.seq_len),
                        seed=config.train.seed)
    optimizer, scheduler = build_optimizer(model, config.optim, config.train.steps)
    dataset = TokenDataset(load_corpus_tokens(), config.data.seq_len)
    size = config.data.micro_batch_size
    order = StatefulSampler(len(dataset), dp_rank=0, dp_size=1, micro_batch_size=size, seed=config.data.seed)
    guard = Guard(own.run_dir, model, optimizer, scheduler, config=config, live_argv=argv)

    def sample_range(step: int, micro_batch: int) -> tuple[int, int]:
        first = (step * guard.micro_batches + micro_batch) * size
        return first, first + size

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        inputs, labels = make_batch(dataset, order.peek_global_indices(sample_range(step, micro_batch)[0], size))
        return token_cross_entropy(model(input_ids=inputs).logits, labels)

    step = guard.resume()
    while not guard.should_stop(step, guard.total_steps):
        step = guard.step(loss_of, sample_range).step
    guard.close()


if __name__ == "__main__":
    main()
