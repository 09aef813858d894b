"""One live FSDP2 group exchange (``fsdp_comms.GroupLink.swap``, as FSDP2's all-gather calls it), this
tree's against another tree's (``--base-src``), side by side in one run.

2 ranks (forked processes) on one gloo group, their waits in a kept ``WaitThread`` as the worker's
``wait_group``; each block times ``--per-block`` exchanges of ``--numel`` float32 values per rank, the two
versions in ABBA order over ``--cycles``. The table gives, per exchange, the median over blocks of the wall
time and of the process's CPU (all its threads: the caller, the wait thread, gloo's), mean of the 2 ranks.
Usage: ``python benchmarks/live_steady_exchange.py --base-src DIR [--numel 4096] [--cycles 4]``, DIR being
a tree's ``src`` (for example ``git archive main src | tar -x -C /tmp/base``).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.live import fsdp_comms
from trainguard.live.wait_thread import WaitThread

VERSIONS = ("this tree", "base")


def base_comms(src: Path):
    """The other tree's ``fsdp_comms`` module (its own imports resolved in this tree: they are unchanged)."""
    spec = importlib.util.spec_from_file_location("base_fsdp_comms", src / "trainguard/live/fsdp_comms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def rank_main(rank: int, port: int, base_src: Path, numel: int, order: list[str], per_block: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("exchange", store), rank, 2, timedelta(seconds=60))
    waits = WaitThread("bench-group-wait")
    base = base_comms(base_src)
    links = {}
    for name, module in zip(VERSIONS, (fsdp_comms, base)):
        channel = module.GroupChannel(group, [0, 1], lambda works: waits.wait(works, lambda: None, lambda: None))
        links[name] = module.GroupLink(rank, 2, lambda channel=channel: channel)
    gathered = torch.empty(2, numel)
    gathered[rank] = torch.randn(numel)
    timed: dict[str, list[tuple[float, float]]] = {name: [] for name in VERSIONS}
    for name in order:
        link = links[name]
        group.barrier().wait()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(per_block):
            link.swap(lambda _position: gathered[rank], lambda position: gathered[position])
        timed[name].append(((time.perf_counter() - wall) / per_block, (time.process_time() - cpu) / per_block))
    results[rank] = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", type=Path, required=True)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--per-block", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=4)
    args = parser.parse_args()
    order = [name for _ in range(args.cycles) for name in VERSIONS + VERSIONS[::-1]]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the ranks' rendezvous
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        procs = [context.Process(target=rank_main, args=(rank, store.port, args.base_src.resolve(), args.numel, order,
                                                         args.per_block, results)) for rank in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        results = dict(results)
    if len(results) != 2:
        sys.exit("a rank did not finish")
    print(f"\nGroupLink.swap, 2 gloo ranks, {args.numel} float32 each, {len(order) // 2} blocks of {args.per_block} "
          f"exchanges per version (ABBA); per exchange, median over blocks, mean of the ranks\n")
    print(f"| {'version':<10} | {'wall µs':>8} | {'process CPU µs':>14} |")
    print(f"|{'-' * 12}|{'-' * 10}|{'-' * 16}|")
    for name in VERSIONS:
        wall = statistics.mean(statistics.median(w for w, _ in results[rank][name]) for rank in range(2))
        cpu = statistics.mean(statistics.median(c for _, c in results[rank][name]) for rank in range(2))
        print(f"| {name:<10} | {1e6 * wall:>8.0f} | {1e6 * cpu:>14.0f} |")


if __name__ == "__main__":
    main()
