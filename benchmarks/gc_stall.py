"""Benchmark: the full garbage collections that durable saves set off in the training loop, side by side.

    OMP_NUM_THREADS=1 python benchmarks/gc_stall.py [--preset llama-tiny] [--every 5] [--block 20] [--cycles 2]

Two gloo ranks (FSDP2, a Llama from a trainguard preset, AdamW, random tokens, as ``nostall.py``) train
in blocks of ``--block`` steps, in ABBA quads: without saves, and with a durable async save every
``--every`` steps (``CheckpointManager.save``, writer process). Every full (generation-2) collection of
the garbage collector is timed (``gc.callbacks``) and charged to the step it falls in: such a
collection scans every object of the process (torch's and transformers' included) holding the GIL,
so the step it falls in waits for it, and the other rank waits at the next collective. Printed: per
mode, the median step, the full collections per 100 steps, the steps that held one, and steps/s
against no saves (median of the quads' ratios). A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import abba_quad, print_result
from nostall import FullCollections, add_model_arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "llama-tiny")
    p.add_argument("--every", type=int, default=5, help="a durable save every this many steps (default 5)")
    p.add_argument("--block", type=int, default=20, help="steps per timed block (default 20)")
    p.add_argument("--cycles", type=int, default=2, help="ABBA quads (default 2)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def inner(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from nostall import build, logging_quiet, max_over_ranks
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    logging_quiet()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    args.device, args.ranks = "cpu", dist.get_world_size()
    model, optimizer, forward_backward, _ = build(args)
    saving = CheckpointManager(Path(args.dir) / "durable", model, optimizer, keep_last=1,
                               config=CheckpointConfig(save_interval=args.every, writer="process"))
    saver = f"durable every {args.every}"
    managers = {"none": None, saver: saving}
    steps: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in managers}  # (step ms, gc ms, count)
    quads: list[dict[str, list[float]]] = []
    step = 0
    order = [("none", -1), (saver, -1)]  # one untimed block of each first
    for cycle in range(args.cycles):
        order += [(mode, cycle) for mode in abba_quad(cycle, "none", saver)]
    with FullCollections() as collections:
        for mode, quad_id in order:
            manager = managers[mode]
            dist.barrier()
            block_started = time.perf_counter()
            records = []
            for _ in range(args.block):
                step += 1
                started, collected, counted = time.perf_counter(), collections.seconds, collections.count
                forward_backward()
                if manager is not None:
                    manager.wait_for_staging()
                optimizer.step()
                optimizer.zero_grad()
                if manager is not None:
                    manager.save(step)
                records.append((1000 * (time.perf_counter() - started), 1000 * (collections.seconds - collected),
                                collections.count - counted))
            if manager is not None:
                manager.close()  # the block's saves are committed within its time
            elapsed = max_over_ranks(time.perf_counter() - block_started)
            if quad_id >= 0:
                steps[mode] += records
                while len(quads) <= quad_id:
                    quads.append({})
                quads[quad_id].setdefault(mode, []).append(args.block / elapsed)
    if dist.get_rank() == 0:
        print(f"\n{args.preset}, 2 ranks, seq {args.seq_len} x batch {args.batch}, blocks of {args.block} steps, "
              f"{args.cycles} ABBA quads; rank 0's steps; load average at the end {os.getloadavg()[0]:.2f}\n")
        print("| mode | median step (ms) | full collections per 100 steps "
              "| steps holding one: ms (of it the collection) |")
        print("|---|---:|---:|---|")
        for mode, records in steps.items():
            held = [f"{ms:.0f} ({gc_ms:.0f})" for ms, gc_ms, count in records if count]
            print(f"| {mode} | {statistics.median(ms for ms, _, _ in records):.0f} | "
                  f"{100 * sum(count for _, _, count in records) / len(records):.1f} | {', '.join(held) or '-'} |")
        ratios = [statistics.median(q[saver]) / statistics.median(q["none"]) for q in quads]
        print(f"\nsteps/s, {saver} vs none: median of quad ratios {statistics.median(ratios):.3f} "
              f"(quads {', '.join(f'{r:.3f}' for r in ratios)})")
        rates = {mode: statistics.median(rate for q in quads for rate in q[mode]) for mode in (saver, "none")}
        print_result(f"steps/s, {saver} vs no saves ({args.preset}; ratio: median of ABBA quad ratios)",
                     rates[saver], rates["none"], "reported, no target", True, ratio=statistics.median(ratios))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.inner:
        inner(args)
        return
    with tempfile.TemporaryDirectory(prefix="gc-stall-") as work:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), "--inner", "--dir", work, "--preset", args.preset,
                   "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--every", str(args.every),
                   "--block", str(args.block), "--cycles", str(args.cycles)]
        raise SystemExit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
