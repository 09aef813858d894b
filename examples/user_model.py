"""What a user's FSDP2 script has before trainguard: a tiny GPT-2 from a transformers config (no
download), token batches drawn from their index, a cosine schedule and the command line. Shared by
``user_loop.py`` (on ``trainguard.Guard``) and ``user_loop_plain.py`` (the same loop without trainguard)."""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 96
SEQ_LEN, MICRO_BATCH_SIZE = 16, 2  # the sequences of one micro-batch


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", required=True, help="where the run keeps its checkpoints and events")
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps (the schedule's horizon)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches of a step's global batch (user_loop_plain.py; user_loop.py: "
                             "the config's train.micro_batches)")
    parser.add_argument("--replicate", type=int, default=1,
                        help="HSDP's replica groups, each sharding the model over world / REPLICATE ranks "
                             "(user_loop_plain.py; 1: FSDP over the world)")
    parser.add_argument("--config", help="a trainguard YAML file (user_loop.py only)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. guards.skip.threshold=50 (user_loop.py only)")
    own, _ = parser.parse_known_args()  # the others: a live launcher's flags, which trainguard reads
    return own


def setup_device() -> torch.device:
    """The rank's device; deterministic kernels (exact resume, bitwise live recovery)."""
    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device("cuda" if cuda else "cpu")


def build_model(device: torch.device, mesh: DeviceMesh | None) -> tuple[GPT2LMHeadModel, GPT2Config]:
    """A 2-layer GPT-2 (tied embeddings, dropout 0.1), every block and then the model ``fully_shard``ed
    over ``mesh`` (None: whole on this rank)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=VOCAB_SIZE - 1, eos_token_id=VOCAB_SIZE - 1)
    model = GPT2LMHeadModel(config).to(device)
    if mesh is not None:
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, config


def cosine(total_steps: int, warmup: int = 2):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


def token_batch(step: int, micro_batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro_batch`` of step ``step``: a pure function of the two (the data position is the
    step), so any rank can compute any micro-batch and a resume needs no data state. Samples are arithmetic
    sequences mod the vocabulary (learnable)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + micro_batch)
    start = torch.randint(VOCAB_SIZE, (MICRO_BATCH_SIZE, 1), generator=gen)
    stride = torch.randint(1, 5, (MICRO_BATCH_SIZE, 1), generator=gen)
    tokens = ((start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB_SIZE).to(device)
    return tokens[:, :-1], tokens[:, 1:]
