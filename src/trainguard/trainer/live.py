"""``python -m trainguard.trainer.live``: a rank of the reference trainer in live mode.

``trainguard train`` with ``fault_tolerance.live: true`` starts this module as every rank through the
live launcher (``cli/train.py``). Each rank builds the whole model from the same seed, and AdamW with its
warmup and cosine schedule, and trains through ``Guard`` in live mode, in the loop of both modes
(``resume``, ``should_stop``, ``step(loss_of)``). With ``fault_tolerance.fsdp: true`` the model is then
sharded with FSDP2 over ``trainguard.data_parallel_mesh()`` (the replica group's mesh), each decoder block
and the root as restart mode shards it (``parallelize.shard_blocks``); without it the model stays whole
and live mode shards a replica group's parameters by rows itself. With ``parallel.tp`` > 1 (and
``fault_tolerance.fsdp``) the decoder blocks are split first over ``trainguard.device_mesh(tp)["tp"]`` by
restart mode's plan (``parallelize.apply_tensor_parallel``), then sharded over its ``dp_shard`` dimension. No PP.
The data position is the step: micro-batch ``m`` of step ``t`` holds the
samples at global positions ``[(t*M + m)*B, (t*M + m + 1)*B)`` of the trainer's seeded order (``M =
train.micro_batches``, ``B = data.micro_batch_size``), so any rank can compute any micro-batch.
The model's Hugging Face config and the tokenizer go into every durable checkpoint (``huggingface/``), so
``trainguard ckpt merge`` needs nothing else.
"""

from __future__ import annotations

import argparse
import sys

import torch

from trainguard.config import load_config
from trainguard.step.guard import Guard
from trainguard.step.mesh import data_parallel_mesh, device_mesh
from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
from trainguard.trainer.model import build_model, build_model_config, token_cross_entropy
from trainguard.trainer.optim import build_optimizer
from trainguard.trainer.parallelize import apply_tensor_parallel, shard_blocks
from trainguard.trainer.tokenizer import ByteTokenizer


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m trainguard.trainer.live")
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", required=True)  # the launcher's
    own, _ = parser.parse_known_args(argv)  # the rest are the launcher's flags, the guard's
    config = load_config(own.config, own.overrides)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model_config = build_model_config(config.model, max_position_embeddings=config.data.seq_len)
    model = build_model(model_config, seed=config.train.seed)
    tp = config.parallel.tp or 1
    if tp > 1:
        mesh = device_mesh(tp, argv)  # the replica group's (dp_shard, tp) mesh
        apply_tensor_parallel(model, mesh["tp"])
        shard_blocks(model, mesh["dp_shard"])
    else:
        mesh = data_parallel_mesh(argv)  # the replica group's with fault_tolerance.fsdp, else None
        if mesh is not None:
            shard_blocks(model, mesh)
    optimizer, scheduler = build_optimizer(model, config.optim, config.train.steps)
    dataset = TokenDataset(load_corpus_tokens(), config.data.seq_len)
    size = config.data.micro_batch_size
    order = StatefulSampler(len(dataset), dp_rank=0, dp_size=1, micro_batch_size=size, seed=config.data.seed)
    guard = Guard(own.run_dir, model, optimizer, scheduler, config=config, live_argv=argv, mesh=mesh,
                  hf_config=model_config, tokenizer=ByteTokenizer(),
                  tokens_per_step=config.train.micro_batches * size * config.data.seq_len)

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
