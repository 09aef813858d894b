"""One live FSDP2 group exchange (``fsdp_comms.GroupLink.swap``, as FSDP2's all-gather calls it) against
gloo's own all-gather of the same tensors (what plain HSDP's FSDP2 calls), and with ``--base-src`` against
another tree's ``GroupLink``, side by side in one run.

2 ranks (spawned processes) on one gloo group; ``GroupLink`` waits in a kept ``WaitThread`` as the worker's
``wait_group``, gloo's all-gather is waited for in the caller. Each block times ``--per-block`` exchanges
of ``--numel`` float32 values per rank, the versions in ABC CBA order over ``--cycles``. The table gives, per
exchange, the median over blocks of the wall time and of the process's CPU (all its threads: the caller,
the wait thread, gloo's), mean of the 2 ranks. Target: our exchange's CPU within 5 % of gloo's all-gather
(the step's target, live within 5 % of plain HSDP, asked of each exchange).
Usage: ``python benchmarks/live_steady_exchange.py [--quick] [--numel 4096] [--cycles 4] [--base-src DIR]``,
DIR being a tree's ``src`` (for example ``git archive main src | tar -x -C /tmp/base``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_result  # noqa: E402
from trainguard.live import fsdp_comms  # noqa: E402
from trainguard.live.wait_thread import WaitThread  # noqa: E402

OURS, GLOO, BASE = "GroupLink", "gloo all-gather", "base GroupLink"
TARGET = 1.05  # our exchange's CPU over gloo's all-gather's


def base_comms(src: Path):
    """The other tree's ``fsdp_comms`` module (its own imports resolved in this tree: they are unchanged)."""
    spec = importlib.util.spec_from_file_location("base_fsdp_comms", src / "trainguard/live/fsdp_comms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def rank_main(rank: int, port: int, base_src: Path | None, numel: int, order: list[str], per_block: int,
              results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("exchange", store), rank, 2, timedelta(seconds=60))
    waits = WaitThread("bench-group-wait")
    gathered = torch.empty(2, numel)
    gathered[rank] = torch.randn(numel)
    chunks = list(gathered.unbind())
    exchanges = {GLOO: lambda: group.allgather([chunks], [chunks[rank]]).wait()}
    for name, module in ((OURS, fsdp_comms), (BASE, None if base_src is None else base_comms(base_src))):
        if module is not None:
            channel = module.GroupChannel(group, [0, 1], lambda works: waits.wait(works, lambda: None, lambda: None))
            # a tree whose GroupLink takes the bound on one exchange's data (a failed peer's answer) is given it
            bound = [gathered[rank].nbytes] if hasattr(module, "largest_exchange_bytes") else []
            link = module.GroupLink(rank, 2, lambda channel=channel: channel, *bound)
            exchanges[name] = lambda link=link: link.swap(lambda _position: chunks[rank], chunks.__getitem__)
    timed: dict[str, list[tuple[float, float]]] = {name: [] for name in exchanges}
    for name in order:
        exchange = exchanges[name]
        group.barrier().wait()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(per_block):
            exchange()
        timed[name].append(((time.perf_counter() - wall) / per_block, (time.process_time() - cpu) / per_block))
    results[rank] = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one cycle of blocks of 50")
    parser.add_argument("--base-src", type=Path, help="also time this trainguard source tree's GroupLink")
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--per-block", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=4)
    args = parser.parse_args()
    cycles, per_block = (1, 50) if args.quick else (args.cycles, args.per_block)
    versions = [OURS, GLOO] + ([BASE] if args.base_src else [])
    order = [name for _ in range(cycles) for name in versions + versions[::-1]]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the ranks' rendezvous
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        base_src = None if args.base_src is None else args.base_src.resolve()
        procs = [context.Process(target=rank_main, args=(rank, store.port, base_src, args.numel, order, per_block,
                                                         results)) for rank in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        results = dict(results)
    if len(results) != 2:
        sys.exit("a rank did not finish")
    print(f"\n2 gloo ranks, {args.numel} float32 each, {2 * cycles} blocks of {per_block} exchanges per version "
          f"(ABC CBA); per exchange, median over blocks, mean of the ranks\n")
    print(f"| {'version':<16} | {'wall µs':>8} | {'process CPU µs':>14} |")
    print(f"|{'-' * 18}|{'-' * 10}|{'-' * 16}|")
    cpu = {}
    for name in versions:
        wall = statistics.mean(statistics.median(w for w, _ in results[rank][name]) for rank in range(2))
        cpu[name] = statistics.mean(statistics.median(c for _, c in results[rank][name]) for rank in range(2))
        print(f"| {name:<16} | {1e6 * wall:>8.0f} | {1e6 * cpu[name]:>14.0f} |")
    print_result("live_fsdp2_exchange_process_cpu_us", 1e6 * cpu[OURS], 1e6 * cpu[GLOO],
                 f"<= {TARGET}x gloo's all-gather", cpu[OURS] <= TARGET * cpu[GLOO], numel=args.numel,
                 blocks=2 * cycles, per_block=per_block)


if __name__ == "__main__":
    main()
