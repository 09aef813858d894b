"""Benchmark: the local tier against the durable tier and ``cp``, on the same HSDP state, in one run.

How it runs: under ``torchrun`` with one process per rank (2 by default: 2 replicas × 1 shard, one rank
per simulated node, each node its own local directory), gloo on CPU::

    OMP_NUM_THREADS=1 python benchmarks/local_ckpt.py [--gib 0.5] [--repeats 3] [--dir /tmp] [--quick]

(re-executes itself under ``torch.distributed.run --standalone --nproc-per-node N``; ``--ranks`` must
be even: ranks/2 shards per replica.)

The state: ``nn.Sequential`` of ``nn.Linear(width, width)`` layers under FSDP2 on a 2-D
``(dp_replicate, dp_shard)`` mesh (HSDP) plus AdamW initialized by one real step, until model +
optimizer state is >= ``--gib`` GiB across ranks. Three figures, each measured in ABBA order (wall
time, the maximum over ranks):

1. *local save vs durable sync save*: ``CheckpointManager.save_local(step)`` (every rank writes its own
   files) against ``CheckpointManager(async_save=False).save_durable(step)`` + ``close()`` (DCP, committed).
   Target: local >= 2x faster.
2. *offline repair vs cp*: node 1's step directory is deleted and ``repair_step`` (the code behind
   ``trainguard ckpt repair``) copies its files back from node 0 (hash while copying, fsync, manifest,
   re-verify), against ``cp`` of the same source files into a scratch directory followed by ``sync`` of
   them (the repair's files are durable; plain ``cp`` is printed too). Throughput = bytes / seconds.
   Target: repair >= 0.8x ``cp``.
3. *online peer recovery vs durable load*: node 1's local directory is deleted, then
   ``LocalTier.recover`` (agreement, transfer over gloo, write, load) against ``DurableCheckpointer.load``
   of the durable checkpoint of the same state. Reported (no target in the issue; "met" = faster).

Numbers on a loaded shared machine are noisy. It is a benchmark: targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median, relaunch_under_torchrun, schedule, silence_console

TARGET_LOCAL_SPEEDUP = 2.0
TARGET_REPAIR_VS_CP = 0.8


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=0.5, help="model + optimizer state across ranks, GiB (default 0.5)")
    p.add_argument("--width", type=int, default=1024, help="nn.Linear width (default 1024)")
    p.add_argument("--repeats", type=int, default=2, help="ABBA cycles per figure (default 2)")
    p.add_argument("--dir", default=None, help="where to write (a temporary directory inside; default /tmp)")
    p.add_argument("--local-dir", default=None,
                   help="node-local storage for the local tier (default /dev/shm when present, else --dir)")
    p.add_argument("--ranks", type=int, default=2, help="ranks when not started by torchrun (even; default 2)")
    p.add_argument("--quick", action="store_true", help="small variant (0.1 GiB, 1 cycle), well under 60 s")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeats = 0.1, 1
    if args.ranks < 2 or args.ranks % 2:
        p.error("--ranks must be even and >= 2")
    return args


def build(args, world: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_layer = 2 * 12 * (args.width * args.width + args.width)  # fp32 param + exp_avg + exp_avg_sq, 2 replicas
    layers = max(1, math.ceil(args.gib * 2**30 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, args.width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return max_over_ranks(time.perf_counter() - started)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(args.ranks, __file__)

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    silence_console()
    from trainguard.fs.layout import step_dir_name
    from trainguard.checkpoint.local.repair import discover, repair_step
    from trainguard.checkpoint.local.tier import LocalTier
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.events import EventLog
    from trainguard.topology.replica_groups import device_mesh_replica_groups

    model, optimizer = build(args, world)
    local_parent = args.local_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else args.dir)
    made = [(tempfile.mkdtemp(prefix="trainguard-local-bench-", dir=args.dir),
             tempfile.mkdtemp(prefix="trainguard-local-bench-", dir=local_parent)) if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    run_dir, local_root = Path(made[0][0]), Path(made[0][1])
    events = EventLog(run_dir / "events.jsonl", rank=rank)
    names = ["dp_replicate", "dp_shard"]
    tier = LocalTier(run_dir, rank=rank, world_size=world, groups=device_mesh_replica_groups([2, world // 2], names),
                     layout={"kind": "device_mesh", "mesh_shape": [2, world // 2], "mesh_dim_names": names},
                     local_dir=str(local_root / "node{node}"), ranks_per_node=world // 2, interval=1, keep_last=2, model=model,
                     events=events, process_group=dist.new_group(backend="gloo"))
    manager = CheckpointManager(run_dir, model, optimizer, async_save=False, keep_last=2, events=events, local=tier,
                                mesh_shape=[2, world // 2], mesh_dim_names=names)
    step = [0]

    def settle() -> None:
        """Every rank's writes and retention finished: only then may rank 0 delete a node's files."""
        tier.wait()
        dist.barrier()

    def local_save() -> None:
        step[0] += 1
        manager.save_local(step[0])

    def durable_save() -> None:
        step[0] += 1
        manager.save_durable(step[0])
        manager.close()

    save = {"local": [], "durable": []}
    for mode in schedule(args.repeats):  # "off" = durable, "on" = local
        name = "local" if mode == "on" else "durable"
        save[name].append(timed(local_save if name == "local" else durable_save))

    # --- offline repair vs cp (rank 0 plays the operator; the others wait)
    node1 = tier.rank_dirs[world - 1]
    repair_rates, cp_rates, cp_plain_rates = [], [], []
    for _ in range(2 * args.repeats):
        local_save()
        settle()
        if rank == 0:
            local = discover(local_root)
            shutil.rmtree(node1 / step_dir_name(step[0]))
            started = time.perf_counter()
            result = repair_step(local, step[0])
            seconds = time.perf_counter() - started
            assert result.verified, "repair did not verify"
            moved = sum(a.transfer.entry.size for a in result.actions)
            sources = sorted({str(a.src_file) for a in result.actions})
            scratch = local_root / "cp-scratch"
            for rates, with_sync in ((cp_plain_rates, False), (cp_rates, True)):
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir()
                started = time.perf_counter()
                subprocess.run(["cp", *sources, str(scratch)], check=True)
                if with_sync:
                    subprocess.run(["sync", *[str(scratch / Path(s).name) for s in sources]], check=True)
                rates.append(moved / (time.perf_counter() - started))
            repair_rates.append(moved / seconds)
        dist.barrier()

    # --- online recovery vs durable load, of the same state
    recover_s, load_s = [], []
    step[0] += 1
    manager.save_durable(step[0])
    manager.close()
    manager.save_local(step[0])
    settle()
    durable_dir = run_dir / "checkpoints" / step_dir_name(step[0])
    for mode in schedule(args.repeats):
        if mode == "on":
            settle()
            if rank == 0:
                shutil.rmtree(node1)
            recover_s.append(timed(lambda: tier.recover(model, optimizer, newer_than=None)))
        else:
            load_s.append(timed(lambda: manager.durable.load(durable_dir, model, optimizer, world)))

    if rank == 0:
        local_s, durable_s = median(save["local"]), median(save["durable"])
        repair, cp, cp_plain = median(repair_rates), median(cp_rates), median(cp_plain_rates)
        rec, load = median(recover_s), median(load_s)
        per_rank_mib = sum(os.path.getsize(p) for p in (tier.dir / step_dir_name(step[0])).glob("*_rank_0.pt")) / 2**20
        print(f"\nlocal tier benchmark: {world} ranks (2 replicas x {world // 2} shards), {per_rank_mib:.0f} MiB "
              f"per rank's files, {args.repeats} ABBA cycles; durable tier in {run_dir.parent}, local tier in "
              f"{local_root.parent} (node-local storage); noisy: shared machine")
        print(f"{'figure':42s} {'trainguard':>12s} {'baseline':>12s} {'ratio':>7s}  target")
        print(f"{'save: local vs durable sync (s)':42s} {local_s:12.3f} {durable_s:12.3f} {durable_s / local_s:7.2f}  "
              f">= {TARGET_LOCAL_SPEEDUP}x faster")
        print(f"{'repair vs cp+sync (MB/s)':42s} {repair / 1e6:12.1f} {cp / 1e6:12.1f} {repair / cp:7.2f}  "
              f">= {TARGET_REPAIR_VS_CP}x")
        print(f"{'repair vs plain cp, no sync (MB/s)':42s} {repair / 1e6:12.1f} {cp_plain / 1e6:12.1f} "
              f"{repair / cp_plain:7.2f}  (for reference)")
        print(f"{'online recovery vs durable load (s)':42s} {rec:12.3f} {load:12.3f} {load / rec:7.2f}  "
              "reported (ratio = durable / local)")
        results = [
            {"figure": "local save speedup vs durable sync save", "trainguard": local_s, "baseline": durable_s,
             "ratio": durable_s / local_s, "target": f">= {TARGET_LOCAL_SPEEDUP}x",
             "met": durable_s / local_s >= TARGET_LOCAL_SPEEDUP},
            {"figure": "offline repair throughput vs cp+sync", "trainguard": repair, "baseline": cp,
             "ratio": repair / cp, "target": f">= {TARGET_REPAIR_VS_CP}x", "met": repair / cp >= TARGET_REPAIR_VS_CP},
            {"figure": "online peer recovery time vs durable load", "trainguard": rec, "baseline": load,
             "ratio": load / rec, "target": "reported (faster = met)", "met": rec < load},
        ]
        for result in results:
            print("RESULT " + json.dumps(result))
    dist.barrier()
    events.close()
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(local_root, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
