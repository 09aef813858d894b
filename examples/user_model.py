"""What a user's FSDP2 script has before trainguard: a tiny GPT-2 from a transformers config (no
download), a resumable token stream, a cosine schedule and the command line. Shared by
``user_loop.py`` (on ``trainguard.Guard``) and ``user_loop_plain.py`` (the same loop without trainguard)."""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 96


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", required=True, help="where the run keeps its checkpoints and events")
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps (the schedule's horizon)")
    parser.add_argument("--config", help="a trainguard YAML file (user_loop.py only)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. guards.skip.threshold=50 (user_loop.py only)")
    return parser.parse_args()


def init_distributed() -> tuple[int, torch.device]:
    """torchrun's process group: nccl on CUDA, gloo on CPU; deterministic kernels (exact resume)."""
    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return dist.get_rank(), torch.device("cuda" if cuda else "cpu")


def build_model(device: torch.device) -> tuple[GPT2LMHeadModel, GPT2Config, DeviceMesh]:
    """A 2-layer GPT-2 (tied embeddings, dropout 0.1), every block and then the model ``fully_shard``ed."""
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=VOCAB_SIZE - 1, eos_token_id=VOCAB_SIZE - 1)
    model = GPT2LMHeadModel(config).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, config, mesh


def cosine(total_steps: int, warmup: int = 2):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


class TokenStream:
    """Batch ``position`` of a rank is a pure function of (position, rank), so the state is the position.
    Samples are arithmetic sequences mod the vocabulary (learnable)."""

    def __init__(self, rank: int, device: torch.device, seq_len: int = 16, batch_size: int = 2):
        self.rank, self.device, self.seq_len, self.batch_size = rank, device, seq_len, batch_size
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1_000_003 * self.position + self.rank)
        start = torch.randint(VOCAB_SIZE, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, 5, (self.batch_size, 1), generator=gen)
        tokens = ((start + stride * torch.arange(self.seq_len + 1)) % VOCAB_SIZE).to(self.device)
        self.position += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}  # plain data: checkpoints load with weights_only=True

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
