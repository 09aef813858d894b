"""One torchft replica group of ``live_recovery.py``'s torchft mode: the live drill's workload
(``trainguard.live.workload``: model, data, AdamW, 8 micro-batches of 4 samples a step) trained with
torchft's ``Manager``, ``DistributedDataParallel`` and ``Optimizer`` wrappers on its ``ProcessGroupGloo``,
as torchft's ``train_ddp.py`` example does (its timeouts: gloo 5 s, manager 30 s).

A replica group is one process here (torchft's DDP: 4 groups x 1 rank make our 4 ranks): group ``g`` of
``G`` computes micro-batches ``[g*8/G, (g+1)*8/G)`` of each step, the data position being torchft's step
(``manager.current_step()``, which a healed replacement takes from its peers). Each attempted step is
one JSON line in ``--log``; the final parameters are saved to ``--final`` (plain tensors, loaded with
``weights_only``). Usage: ``python benchmarks/torchft_worker.py --group 3 --groups 4 --steps 60 ...``
with ``TORCHFT_LIGHTHOUSE`` set (the benchmark starts the lighthouse).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from trainguard.live.workload import Workload


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--micro-batch-s", type=float, required=True, help="simulated compute per micro-batch")
    p.add_argument("--log", required=True, help="JSON lines: one per attempted step")
    p.add_argument("--final", required=True, help="where the final parameters are saved")
    p.add_argument("--ready-dir", help="the job's start: wait here until every group's manager is up")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    workload = Workload()
    per_group = workload.micro_batches // args.groups
    mine = range(args.group * per_group, (args.group + 1) * per_group)
    model, inner = workload.build()
    # each replica group has its own store (torchft's MASTER_ADDR/MASTER_PORT); with one rank per group
    # that rank hosts it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{args.group}",
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
    )
    if args.ready_dir:
        # every group's manager heartbeating before the first quorum: the lighthouse then waits for all of
        # them (its join timeout) instead of starting with the first half that asks
        ready = Path(args.ready_dir)
        (ready / str(args.group)).touch()
        while len(list(ready.iterdir())) < args.groups:
            time.sleep(0.01)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    with open(args.log, "a", buffering=1) as log:
        while manager.current_step() < args.steps:
            started = time.time()
            optimizer.zero_grad()  # starts the quorum (a replacement heals from a peer here)
            step = manager.current_step()
            xs, ys = (torch.cat(parts) for parts in zip(*(workload.batch(step, m) for m in mine)))
            # the mean of the micro-batches' losses in one forward (DDP wants one per backward)
            loss = ((ddp(xs) - ys) ** 2).sum() / (workload.micro_batch_size * len(mine))
            time.sleep(args.micro_batch_s * len(mine))  # the compute time, as in the live drill
            loss.backward()  # DDP's all-reduce averages over the quorum's participants
            optimizer.step()  # steps the optimizer only if every participant's all-reduce succeeded
            log.write(json.dumps({"group": args.group, "pid": os.getpid(), "step": step, "start": started,
                                  "end": time.time(), "committed": manager.current_step() > step,
                                  "participants": manager.num_participants(), "micro_batches": len(mine)}) + "\n")
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, args.final)
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's background threads would hold the exit; everything is written


if __name__ == "__main__":
    main()
