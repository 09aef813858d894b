"""trainguard in your own FSDP2 training loop: durable checkpoints, exact resume, true global-norm clipping.

Everything here is an ordinary FSDP2 loop (a tiny causal transformer, ``fully_shard``, AdamW, an LR
schedule, a data iterator with ``state_dict``/``load_state_dict``); a Hugging Face model is sharded the
same way (``fully_shard`` each of ``model.model.layers``, then the model). The trainguard part is the lines
marked ``# trainguard``: build a ``CheckpointManager``, ``resume()``, ``clip_grad_norm_``, ``save``, ``close``.
``trainguard.Guard`` does all of that and every guard in one call per step: see ``docs/library.md``.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_loop.py --run-dir runs/ex --steps 20

Run the same command again (or after killing it) and it continues from the newest checkpoint that
verifies, bit-identical to a run that never stopped. ``--stop-after N`` stops (and saves) after step N
without changing the LR schedule, which is set by ``--steps``. gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard
from trainguard.checkpoint.config import CheckpointConfig


class TinyCausalLM(nn.Module):
    """Embedding, pre-norm transformer blocks with a causal mask and dropout, an output head."""

    def __init__(self, vocab_size: int = 128, dim: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class SyntheticTokens:
    """A resumable data iterator: batch ``position`` of a rank is a pure function of (seed, position, rank),
    so its whole state is the position. Samples are arithmetic sequences mod the vocabulary (learnable)."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, rank: int, seed: int = 1234):
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.rank, self.seed = rank, seed
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * self.position + self.rank)
        start = torch.randint(self.vocab_size, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, 8, (self.batch_size, 1), generator=gen)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        self.position += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}  # plain data: checkpoints load with weights_only=True

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="checkpoints go to RUN_DIR/checkpoints/global_step_N")
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps (the LR schedule's horizon)")
    parser.add_argument("--stop-after", type=int, help="save and stop after this step (a planned interruption)")
    parser.add_argument("--save-interval", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def lr_lambda(total_steps: int, warmup: int = 2):
    def factor(step: int) -> float:  # linear warmup, then cosine to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    torch.use_deterministic_algorithms(True, warn_only=True)  # bitwise resume needs deterministic kernels
    # trainguard logs "resumed from ..." and "checkpoint global_step_N staged" on the "trainguard" logger.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(name)s: %(message)s")

    # Seed every RNG, the same on every rank (same initial weights): trainguard saves and restores all
    # of them (python, numpy, torch CPU and CUDA), so a resumed run draws what a straight one would.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=128).to(device)  # dropout 0.1: a resume must restore the RNGs
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps))
    data = SyntheticTokens(vocab_size=128, seq_len=32, batch_size=4, rank=rank)

    ckpt = trainguard.CheckpointManager(  # trainguard
        args.run_dir, model, optimizer, {"scheduler": scheduler, "data": data},
        CheckpointConfig(save_interval=args.save_interval, keep_last=3),
    )
    start = ckpt.resume()  # trainguard: newest verified checkpoint (or 0); restores every state and RNG
    if rank == 0 and start:
        print(f"resumed from step {start}", flush=True)
    stop = min(args.steps, args.stop_after or args.steps)
    for step in range(start + 1, stop + 1):
        inputs, labels = data.next_batch()
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten())
        loss.backward()
        grad_norm = trainguard.clip_grad_norm_(model.parameters(), max_norm=1.0)  # trainguard
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.4f} grad_norm {grad_norm:.4f}", flush=True)
        # trainguard: saves every save_interval steps and at the last one (async; returns once staged)
        ckpt.save(step, {"step": step, "loss": loss.item()}, last_step=step == stop)
    ckpt.close()  # trainguard: wait until the last checkpoint is committed on every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
