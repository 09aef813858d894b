"""A user's own FSDP2 training loop on ``trainguard.Guard``: every guard, both checkpoint tiers, the
lifecycle and fault drills, configured by user_loop.yaml (user_loop_plain.py is the same loop without).

    trainguard run --max-restarts 3 -- torchrun --standalone --nproc-per-node 2 examples/user_loop.py \\
        --run-dir runs/user --steps 20 --config examples/user_loop.yaml
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainguard
from user_model import TokenStream, build_model, cosine, init_distributed, parse_args


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    rank, device = init_distributed()
    model, hf_config, mesh = build_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.steps))
    data = TokenStream(rank, device)

    guard = trainguard.Guard(args.run_dir, model, optimizer, scheduler=scheduler, stateful={"data": data},
                             config=args.config, overrides=args.overrides, mesh=mesh, hf_config=hf_config)
    # a config mistake (file, --set or TRAINGUARD_FAULTS) ended every rank above: one line, exit 2
    step = guard.resume()  # the newest verified healthy checkpoint (0 when fresh), every RNG, the data position
    while not guard.should_stop(step, args.steps):  # kill switch, SIGTERM/SIGUSR1, time limit
        def closure() -> torch.Tensor:  # forward and backward; the guard may run it twice (SDC rerun)
            inputs, labels = data.next_batch()
            loss = F.cross_entropy(model(input_ids=inputs).logits.float().flatten(0, 1), labels.flatten())
            loss.backward()
            return loss

        outcome = guard.step(closure)  # measure, guard, clip, optimizer.step(), scheduler.step(), save
        step = outcome.step
        if rank == 0:
            print(f"step {step} loss {outcome.loss:.4f} norm {outcome.global_norm:.4f}"
                  f"{' skipped' if outcome.skipped else ''}", flush=True)
    code = guard.close()  # waits for the last commit: 0, or 16 after a signal or time-limit stop
    dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
