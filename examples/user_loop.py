"""A user's own FSDP2 training loop on ``trainguard.Guard``: every guard, both checkpoint tiers, the
lifecycle and fault drills, configured by user_loop.yaml (user_loop_plain.py is the same loop without).

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 2 examples/user_loop.py \\
        --run-dir runs/user --steps 20 --config examples/user_loop.yaml

The same file trains with live recovery (a rank dies, the others keep stepping, its replacement rejoins;
the same result) when its configuration says ``fault_tolerance.live: true``, started by the live
launcher instead of torchrun: docs/live_recovery.md ("In your own script").
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainguard
from user_model import build_model, cosine, parse_args, setup_device, token_batch


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    device = setup_device()
    mesh = trainguard.data_parallel_mesh()  # torchrun: FSDP2 over the world; live: None, the whole model
    model, hf_config = build_model(device, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.steps))

    guard = trainguard.Guard(args.run_dir, model, optimizer, scheduler=scheduler, config=args.config,
                             overrides=args.overrides, mesh=mesh, hf_config=hf_config)
    # a config mistake (file, --set or TRAINGUARD_FAULTS) ended every rank above: one line, exit 2

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        inputs, labels = token_batch(step, micro_batch, device)  # a pure function of (step, micro_batch)
        return F.cross_entropy(model(input_ids=inputs).logits.float().flatten(0, 1), labels.flatten())

    step = guard.resume()  # the newest verified healthy checkpoint (0 when fresh), or a live rank's rejoin
    while not guard.should_stop(step, args.steps):  # kill switch, SIGTERM/SIGUSR1, time limit
        outcome = guard.step(loss_of)  # this rank's micro-batches, guard, clip, update, save (live: recover)
        step = outcome.step
        if guard.rank == 0:
            print(f"step {step} loss {outcome.loss:.4f} norm {outcome.global_norm:.4f}"
                  f"{' skipped' if outcome.skipped else ''}", flush=True)
    code = guard.close()  # waits for the last commit: 0, or 16 after a signal or time-limit stop
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
