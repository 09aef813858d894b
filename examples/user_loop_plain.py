"""A user's own FSDP2 training loop without trainguard (compare with user_loop.py).

    torchrun --standalone --nproc-per-node 2 examples/user_loop_plain.py --run-dir runs/plain --steps 20
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from user_model import TokenStream, build_model, cosine, init_distributed, parse_args


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    rank, device = init_distributed()
    model, _, _ = build_model(device)  # the model, its config, the mesh
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.steps))
    data = TokenStream(rank, device)

    step = 0
    while step < args.steps:
        inputs, labels = data.next_batch()
        loss = F.cross_entropy(model(input_ids=inputs).logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).full_tensor()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} norm {norm.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
