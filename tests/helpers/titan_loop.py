"""A loop on torchtitan's own components (0.3) and trainguard.Guard: its Llama 3 model (a tiny config of
its ``debugmodel``'s shape), its ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer`` (warmup,
stable, linear decay), FSDP2 over 2 gloo ranks, a resumable synthetic token stream.

    torchrun --nproc-per-node 2 titan_loop.py --run-dir D --steps N [--set section.key=value ...]

torchtitan's Trainer needs CUDA; its components run on CPU, but FlexAttention has no backward on CPU,
so the blocks use torchtitan's ``ScaledDotProductAttention`` (causal, no masks). Rank 0 prints
``outcome step=S loss=L lr=R`` per step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import ScaledDotProductAttention

import trainguard
from guard_loop import TokenStream, start_ranks
from trainguard.integrations.torchtitan import guard_components

VOCAB, DIM, HEADS, SEQ = 96, 32, 4, 16


def tiny_llama3() -> torch.nn.Module:
    """torchtitan's ``Llama3Model`` as its ``debugmodel`` flavour builds it, at a few thousandths of its size."""
    layers = llama3._build_llama3_layers(
        fuse_qkv=False, n_layers=2, dim=DIM, n_heads=HEADS, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"), attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)))
    return config.build()


def main() -> None:
    args, rank, world = start_ranks()
    model = tiny_llama3()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = dataclasses.replace(default_adamw(lr=3e-3), implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=args.steps)
    data = TokenStream(rank, vocab_size=VOCAB, seq_len=SEQ)
    positions = torch.arange(SEQ).expand(data.batch_size, SEQ)

    parts = guard_components(optimizers, lr_schedulers)
    guard = trainguard.Guard(args.run_dir, model, parts.optimizer, scheduler=parts.scheduler, stateful={"data": data},
                             config=None, overrides=args.overrides, mesh=mesh)
    step = guard.resume()
    while not guard.should_stop(step, args.steps):
        def closure() -> torch.Tensor:
            inputs, labels = data.next_batch()
            logits = model(inputs, positions=positions)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            return loss

        outcome = guard.step(closure)
        step = outcome.step
        if rank == 0:
            print(f"outcome step={outcome.step} loss={outcome.loss:.6f} lr={lr_schedulers.schedulers[0].get_last_lr()[0]:.6g}",
                  flush=True)
    code = guard.close()
    dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
