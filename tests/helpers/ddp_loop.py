"""A user's own DDP loop (not FSDP2) on trainguard.Guard: a tiny Qwen2 built from a transformers config,
``DistributedDataParallel`` over gloo, AdamW, a resumable synthetic token stream.

    torchrun --nproc-per-node 4 ddp_loop.py --run-dir D --steps N [--set section.key=value ...]

Rank 0 prints ``outcome step=S norm=X`` per step, the global norm with every digit (``float.hex``).
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import Qwen2ForCausalLM

import trainguard
from guard_loop import TokenStream, start_ranks, tiny_qwen2_config

FIND_UNUSED = os.environ.get("DDP_FIND_UNUSED_PARAMETERS") == "1"
"""DDP's ``find_unused_parameters``: with it on (and ``static_graph`` off) DDP never rebuilds its buckets."""


def train() -> int:
    """The user's loop; ``guard.close()``'s code once every rank has closed."""
    args, rank, world = start_ranks()
    model = DistributedDataParallel(Qwen2ForCausalLM(tiny_qwen2_config()), find_unused_parameters=FIND_UNUSED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = TokenStream(rank)

    guard = trainguard.Guard(args.run_dir, model, optimizer, stateful={"data": data}, overrides=args.overrides)
    step = guard.resume()
    while not guard.should_stop(step, args.steps):
        def closure() -> torch.Tensor:
            inputs, labels = data.next_batch()
            loss = F.cross_entropy(model(input_ids=inputs).logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            return loss

        outcome = guard.step(closure)
        step = outcome.step
        if rank == 0:
            print(f"outcome step={outcome.step} norm={outcome.global_norm.hex()}", flush=True)
    code = guard.close()
    dist.barrier()
    return code


def main() -> None:
    code = train()
    # DDP freed (its frame left) before the group is destroyed: left to the interpreter's exit, its reducer drops
    # the gloo group's last reference holding the GIL while the group's destructor joins a thread that waits for
    # it (the hang examples/hf_trainer.py's ending avoids the same way)
    gc.collect()
    dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
