"""A user's own FSDP2 loop on trainguard.Guard, not written for the reference trainer: a tiny Qwen2 built
from a transformers config, AdamW, a cosine schedule, a resumable synthetic token stream.

    torchrun --nproc-per-node 2 guard_loop.py --run-dir D --steps N [--set section.key=value ...]

Rank 0 prints one line per step outcome: ``outcome step=S skipped=B applied=B norm=X``, and at the end
``run outcome=O finished=B code=C`` (``Guard.outcome``, ``Guard.finished``, ``close()``'s code).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

import trainguard
from trainguard.config import load_config


class TokenStream:
    """Batch ``position`` of a rank is a pure function of (position, rank): the state is the position."""

    def __init__(self, rank: int, vocab_size: int = 96, seq_len: int = 16, batch_size: int = 2):
        self.rank, self.vocab_size, self.seq_len, self.batch_size = rank, vocab_size, seq_len, batch_size
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1_000_003 * self.position + self.rank)
        start = torch.randint(self.vocab_size, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, 5, (self.batch_size, 1), generator=gen)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        self.position += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def start_ranks() -> tuple[argparse.Namespace, int, int]:
    """``--run-dir D --steps N [--set K=V ...]``, the gloo group, deterministic kernels, the same seed on every
    rank; returns (arguments, rank, world size)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    return args, dist.get_rank(), dist.get_world_size()


def tiny_qwen2_config() -> Qwen2Config:
    """The loops' model: two layers, a vocabulary of ``TokenStream``'s 96 tokens."""
    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def main() -> None:
    args, rank, world = start_ranks()
    hf_config = tiny_qwen2_config()
    model = Qwen2ForCausalLM(hf_config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    data = TokenStream(rank)

    guard = trainguard.Guard(args.run_dir, model, optimizer, scheduler=scheduler, stateful={"data": data},
                             config=load_config(None, args.overrides), mesh=mesh, hf_config=hf_config)
    step = guard.resume()
    while not guard.should_stop(step, args.steps):
        def closure() -> torch.Tensor:
            inputs, labels = data.next_batch()
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            return loss

        outcome = guard.step(closure)
        step = outcome.step
        if rank == 0:
            print(f"outcome step={outcome.step} skipped={outcome.skipped} applied={outcome.applied} "
                  f"norm={outcome.global_norm:.4f}", flush=True)
    code = guard.close()
    if rank == 0:  # 0 alone does not say whether the model is the trained one
        print(f"run outcome={guard.outcome.value} finished={guard.finished} code={code}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
