"""A user's own FSDP2 training loop without trainguard (compare with user_loop.py).

    torchrun --standalone --nproc-per-node 2 examples/user_loop_plain.py --run-dir runs/plain --steps 20
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from user_model import build_model, cosine, parse_args, setup_device, token_batch


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    device = setup_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.replicate > 1:  # HSDP: replicas of a model sharded inside each group
        mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    model, _ = build_model(device, mesh)  # the model, its config
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.steps))

    step = 0
    while step < args.steps:
        loss = 0.0
        for micro_batch in range(rank, args.micro_batches, world):  # this rank's share of the global batch
            inputs, labels = token_batch(step, micro_batch, device)
            share = F.cross_entropy(model(input_ids=inputs).logits.float().flatten(0, 1), labels.flatten())
            share = share * world / args.micro_batches  # FSDP averages over the ranks: the mean of the batch
            share.backward()
            loss += share.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).full_tensor()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss:.4f} norm {norm.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
