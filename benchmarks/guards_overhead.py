"""Benchmark: step time with the numeric guards (data skip + embedding health monitoring) on vs off.

How it runs: under ``torchrun``, one process per rank (4 by default: HSDP dp_replicate=2 x dp_shard=2),
gloo on CPU::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        benchmarks/guards_overhead.py [--preset llama-60m] [--block 2] [--cycles 14] [--json out.json]

Started without torchrun (``python benchmarks/guards_overhead.py``) it re-executes itself under
``torch.distributed.run --standalone --nproc-per-node N`` (``--ranks``, default 4), with
``OMP_NUM_THREADS=1`` unless set.

One training process per rank builds trainguard's real ``Trainer`` (the ~60M ``llama-60m`` preset,
seq_len 64, micro-batch 1 by default; no checkpoints: ``save_interval 0``, ``resume disable``) with both
guards enabled in the config and thresholds no step reaches (skip threshold 1e9, health embedding
threshold 1e9), so nothing is ever skipped. It then switches the guards between steps:

* on:  ``trainer.skip_guard = <the DataSkipGuard built from the config>``, ``trainer.monitor_embedding = True``
* off: ``trainer.skip_guard = None``, ``trainer.monitor_embedding = False``

Steps run in blocks of ``--block`` steps, all in one process, one model and one optimizer, so on and off
see the same machine state. Each cycle is four blocks in ABBA order (off on on off, then on off off on
for the next cycle, and so on), so neither mode always runs first or after the other. ``--warmup``
steps (alternating modes) are run first and not counted.

What is timed:

* step: ``StepResult.seconds`` returned by ``Trainer.train_step`` (forward, backward, the global-norm
  all-reduce carrying the embedding norms, the skip decision with its log lines, clipping, optimizer
  step), the maximum over ranks (an all-reduce MAX made after the step, outside the timed region).
* report: rank 0's ``Trainer._report`` after the step, as ``Trainer.run`` calls it (the step log line,
  plus the embedding-norm line when monitoring, and the ``step`` event). The other ranks wait for it.
* where the step goes: the phases of ``train_step`` timed by wrapping, in this process only, the
  Trainer's ``_forward_backward``, ``_monitored_extras``, ``optimizer.step`` and the guard's ``decide``,
  and the ``global_norm_and_sums`` and ``clip_grads_`` that ``trainguard.trainer.loop`` calls
  (trainguard itself is unchanged); each phase is the maximum over ranks, per step. The guards can only
  change ``_monitored_extras``, the global-norm all-reduce (one more double per rank with monitoring), ``skip
  decide`` and the rest (its log lines); a difference in forward+backward or optimizer.step is noise.
* the guards' own pieces in isolation, after the training blocks, many calls each: ``_checkpoint_health()``
  (the verdict made at save time, pure CPU on values already all-reduced), ``_monitored_extras`` on vs
  off, ``DataSkipGuard.decide`` plus logging its lines, and the all-reduce of the norm buffer with and
  without the per-rank embedding slots.

Noise: the blocks of each mode are split into two interleaved halves (A = its 1st, 3rd, ... block, B =
2nd, 4th, ...) and the same statistic compares off A with off B (and on A with on B): what the
"overhead" of a mode against itself is. The per-cycle overhead (on vs off medians within each cycle)
shows the spread too.

rank 0's console log handler is removed (its file handler stays), so the output is the benchmark's.

It is a benchmark: the target (overhead <= 1 %) is reported as met or missed, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET_OVERHEAD = 0.01  # (on - off) / off median step time, at most

MODES = ("off", "on")

from common import print_result, silence_console, median, rel, relaunch_under_torchrun, schedule


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-60m", help="model.preset (default llama-60m)")
    p.add_argument("--seq-len", type=int, default=64, help="data.seq_len (default 64)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="data.micro_batch_size (default 1)")
    p.add_argument("--dp-replicate", type=int, default=2, help="parallel.dp_replicate (default 2)")
    p.add_argument("--dp-shard", type=int, default=2, help="parallel.dp_shard (default 2)")
    p.add_argument("--block", type=int, default=2, help="steps per block (default 2)")
    p.add_argument("--cycles", type=int, default=14,
                   help="cycles of 4 blocks (2 on, 2 off) each (default 14: 56 timed steps per mode)")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps first (default 6)")
    p.add_argument("--calls", type=int, default=2000, help="calls per guard piece timed in isolation (default 2000)")
    p.add_argument("--dir", default=None, help="where the run directory is made (deleted after; default /tmp)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--ranks", type=int, default=4, help="ranks when not started by torchrun (default 4)")
    p.add_argument("--quick", action="store_true", help="a small variant: --preset llama-tiny --cycles 3 --warmup 2 --calls 200")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.cycles, args.warmup, args.calls = "llama-tiny", 3, 2, 200
    if args.block < 1 or args.cycles < 1 or args.warmup < 0 or args.calls < 1:
        p.error("--block >= 1, --cycles >= 1, --warmup >= 0 and --calls >= 1 are required")
    return args


# ---------------------------------------------------------------------------------------------- stats
def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile, ``q`` in [0, 1]."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": median(values), "p10": quantile(values, 0.1), "p90": quantile(values, 0.9),
            "min": min(values) if values else float("nan"), "max": max(values) if values else float("nan")}


def summarize(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    step = {m: [s for b in blocks if b["mode"] == m for s in b["step_s"]] for m in MODES}
    report = {m: [s for b in blocks if b["mode"] == m for s in b["report_s"]] for m in MODES}
    both = {m: [a + r for b in blocks if b["mode"] == m for a, r in zip(b["step_s"], b["report_s"])] for m in MODES}
    rows = {m: {"step": describe(step[m]), "report": describe(report[m]), "step_plus_report": describe(both[m])}
            for m in MODES}
    for m in MODES:
        rows[m]["phases_median"] = {
            p: median([ph[p] for b in blocks if b["mode"] == m for ph in b["phases_s"]]) for p in PHASES}
        rows[m]["phases_median"][REST] = median([ph[REST] for b in blocks if b["mode"] == m for ph in b["phases_s"]])
    overhead = rel(rows["on"]["step"]["median"], rows["off"]["step"]["median"])
    overhead_with_report = rel(rows["on"]["step_plus_report"]["median"], rows["off"]["step_plus_report"]["median"])

    # noise: each mode's blocks split into interleaved halves A (1st, 3rd, ...) and B (2nd, 4th, ...)
    halves: dict[str, dict[str, list[float]]] = {}
    for m in MODES:
        mine = [b for b in blocks if b["mode"] == m]
        halves[m] = {"A": [s for b in mine[0::2] for s in b["step_s"]], "B": [s for b in mine[1::2] for s in b["step_s"]]}
    noise = {m: rel(median(halves[m]["B"]), median(halves[m]["A"])) for m in MODES}
    noise_halves = {m: {h: describe(v) for h, v in halves[m].items()} for m in MODES}

    per_cycle = []
    cycles = sorted({b["cycle"] for b in blocks})
    for c in cycles:
        on = [s for b in blocks if b["cycle"] == c and b["mode"] == "on" for s in b["step_s"]]
        off = [s for b in blocks if b["cycle"] == c and b["mode"] == "off" for s in b["step_s"]]
        per_cycle.append(rel(median(on), median(off)))
    return {
        "rows": rows,
        "overhead": {"value": overhead, "target": f"<= {TARGET_OVERHEAD}", "met": overhead <= TARGET_OVERHEAD,
                     "with_rank0_report": overhead_with_report,
                     "per_cycle": per_cycle, "per_cycle_median": median(per_cycle)},
        "noise": {"off_B_vs_off_A": noise["off"], "on_B_vs_on_A": noise["on"], "halves": noise_halves},
    }


# ------------------------------------------------------------------------------------------ phases
PHASES = ("forward+backward", "_monitored_extras", "global norm (local sq-sum + all-reduce)", "skip decide",
          "clip", "optimizer.step")
REST = "rest of train_step (skip log lines, zero_grad, ...)"


class PhaseTimer:
    """Seconds per phase of the current step, from wrappers set in this process only (trainguard unchanged)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, name: str, fn: Callable) -> Callable:
        # functools.wraps also copies the LR scheduler's mark on optimizer.step (no "overridden" warning)
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return wrapper


def instrument(trainer, guard, timer: PhaseTimer) -> None:
    from trainguard.trainer import loop

    trainer._forward_backward = timer.wrap("forward+backward", trainer._forward_backward)
    trainer._monitored_extras = timer.wrap("_monitored_extras", trainer._monitored_extras)
    loop.global_norm_and_sums = timer.wrap("global norm (local sq-sum + all-reduce)", loop.global_norm_and_sums)
    loop.clip_grads_ = timer.wrap("clip", loop.clip_grads_)
    guard.decide = timer.wrap("skip decide", guard.decide)
    trainer.optimizer.step = timer.wrap("optimizer.step", trainer.optimizer.step)


# ------------------------------------------------------------------------------------------ pieces
def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds per call over ``calls`` calls, timed in 20 batches (tiny calls need batching)."""
    batches = 20
    per_batch = max(1, calls // batches)
    samples = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - started) / per_batch)
    return median(samples)


def time_pieces(trainer, guard, skip_cfg, last_norm: float, embedding_max: float | None, calls: int) -> dict[str, Any]:
    """The guards' own work in isolation, on this rank; collectives are timed on every rank together."""
    import torch
    import torch.distributed as dist

    from trainguard.guards.skip import DataSkipGuard, reference_log_lines

    pieces: dict[str, float] = {}
    loss = torch.zeros((), dtype=torch.float64, device=trainer.device)

    trainer.max_embedding_norm = embedding_max
    pieces["_checkpoint_health()"] = time_calls(trainer._checkpoint_health, calls)

    for mode in MODES:
        trainer.monitor_embedding = mode == "on"
        pieces[f"_monitored_extras {mode}"] = time_calls(lambda: trainer._monitored_extras(loss), calls)

    fresh = DataSkipGuard(skip_cfg)  # not the run's guard: decide() updates its window and counts
    step_box = [0]

    def decide_and_log():
        step_box[0] += 1
        decision = fresh.decide(step_box[0], last_norm, opt_global_step=step_box[0] - 1)
        for line in reference_log_lines(decision):
            trainer.log.info(line)

    pieces["skip decide + log lines"] = time_calls(decide_and_log, calls)
    pieces["skip decide only"] = time_calls(lambda: fresh.decide(1, last_norm, opt_global_step=0), calls)

    # the norm all-reduce: 1 (norm) + 1 (loss) doubles off, + world_size embedding slots on
    world = dist.get_world_size()
    reduce_calls = max(20, calls // 10)
    reduce_samples: dict[str, list[float]] = {m: [] for m in MODES}
    buffers = {"off": torch.zeros(2, dtype=torch.float64), "on": torch.zeros(2 + world, dtype=torch.float64)}
    for i in range(reduce_calls):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffers[mode])
            reduce_samples[mode].append(time.perf_counter() - started)
    for mode in MODES:
        pieces[f"norm all-reduce {mode} ({buffers[mode].numel()} doubles)"] = median(reduce_samples[mode])

    # max over ranks of each piece's median
    names = sorted(pieces)
    values = torch.tensor([pieces[n] for n in names], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(names, values.tolist()))


# -------------------------------------------------------------------------------------------- report
def print_report(summary: dict[str, Any], pieces: dict[str, float], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(
        f"{meta['preset']} ({meta['params'] / 1e6:.1f}M params), {meta['world']} ranks HSDP dp_replicate "
        f"{meta['dp_replicate']} x dp_shard {meta['dp_shard']}, gloo on CPU, seq_len {meta['seq_len']}, "
        f"micro-batch {meta['micro_batch_size']}; {meta['cycles']} ABBA cycles of {meta['block']}-step blocks "
        f"({summary['rows']['on']['step']['n']} timed steps per mode, +{meta['warmup']} warm-up); "
        f"skipped steps {meta['skipped_total']}; torch {meta['torch']}; {meta['cpus']} CPUs; "
        f"wall {meta['wall_s']:.0f}s"
    )
    rows, ov = summary["rows"], summary["overhead"]
    off = rows["off"]["step"]["median"]
    table = Table(title="step time, guards on vs off (StepResult.seconds, max over ranks)")
    for col in ("mode", "steps", "median step ms", "p10 ms", "p90 ms", "overhead", "target",
                "rank-0 report ms", "step+report ms"):
        table.add_column(col, justify="left" if col in ("mode", "target") else "right")
    for mode in MODES:
        r = rows[mode]
        if mode == "on":
            overhead = f"{100 * rel(r['step']['median'], off):+.2f} %"
            target = f"<= {100 * TARGET_OVERHEAD:.0f} %: {'met' if ov['met'] else 'MISSED'}"
        else:
            overhead, target = "-", ""
        table.add_row(mode, str(r["step"]["n"]), f"{1e3 * r['step']['median']:.1f}", f"{1e3 * r['step']['p10']:.1f}",
                      f"{1e3 * r['step']['p90']:.1f}", overhead, target, f"{1e3 * r['report']['median']:.3f}",
                      f"{1e3 * r['step_plus_report']['median']:.1f}")
    console.print(table)
    noise = summary["noise"]
    console.print(
        f"overhead including rank 0's report: {100 * ov['with_rank0_report']:+.2f} %; per cycle (on vs off medians "
        f"within the cycle): " + ", ".join(f"{100 * v:+.2f}" for v in ov["per_cycle"])
        + f" % -> median {100 * ov['per_cycle_median']:+.2f} %"
    )
    noise_size = max(abs(noise["off_B_vs_off_A"]), abs(noise["on_B_vs_on_A"]))
    within = "within" if abs(ov["value"]) <= noise_size else "outside"
    console.print(
        f"noise (same mode, interleaved halves of its blocks): off B vs off A {100 * noise['off_B_vs_off_A']:+.2f} %, "
        f"on B vs on A {100 * noise['on_B_vs_on_A']:+.2f} %: the overhead {100 * ov['value']:+.2f} % is {within} "
        f"the noise ({100 * noise_size:.2f} %)"
    )
    phtable = Table(title="where the step goes (median per step of each phase, each the max over ranks; the "
                          "all-reduce phase includes waiting for the slowest rank)")
    for col in ("phase", "off ms", "on ms", "on - off ms"):
        phtable.add_column(col, justify="left" if col == "phase" else "right")
    for name in rows["off"]["phases_median"]:
        a, b = rows["off"]["phases_median"][name], rows["on"]["phases_median"][name]
        phtable.add_row(name, f"{1e3 * a:.2f}", f"{1e3 * b:.2f}", f"{1e3 * (b - a):+.2f}")
    console.print(phtable)
    step_off = off
    ptable = Table(title="the guards' pieces in isolation (median per call, max over ranks)")
    for col in ("piece", "us per call", "% of off step"):
        ptable.add_column(col, justify="left" if col == "piece" else "right")
    for name, seconds in pieces.items():
        ptable.add_row(name, f"{1e6 * seconds:.2f}", f"{100 * seconds / step_off:.4f}")
    console.print(ptable)
    extra = (pieces["skip decide + log lines"] + pieces["_monitored_extras on"] - pieces["_monitored_extras off"]
             + max(0.0, pieces[next(n for n in pieces if n.startswith("norm all-reduce on"))]
                   - pieces[next(n for n in pieces if n.startswith("norm all-reduce off"))]))
    console.print(f"sum of the per-step pieces the guards add (skip decide + log, extras on - off, all-reduce "
                  f"on - off): {1e6 * extra:.1f} us = {100 * extra / step_off:.4f} % of the off step")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(args.ranks, __file__)
    wall_started = time.perf_counter()

    import torch
    import torch.distributed as dist

    from trainguard.config import load_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True, warn_only=True)  # as trainguard.trainer.entry does
    from trainguard.trainer.loop import Trainer

    cycles_steps = 4 * args.block * args.cycles
    overrides = [
        f"model.preset={args.preset}",
        f"data.seq_len={args.seq_len}",
        f"data.micro_batch_size={args.micro_batch_size}",
        f"parallel.dp_replicate={args.dp_replicate}",
        f"parallel.dp_shard={args.dp_shard}",
        f"train.steps={args.warmup + cycles_steps}",
        "checkpoint.save_interval=0",
        "checkpoint.resume=disable",
        "guards.skip.enabled=true",
        "guards.skip.threshold=1e9",
        "guards.health.enabled=true",
        "guards.health.embedding_threshold=1e9",
    ]
    config = load_config(None, overrides)

    made = [None]
    if rank == 0:
        parent = Path(args.dir or tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        made = [tempfile.mkdtemp(prefix="trainguard-guards-bench-", dir=parent)]
    dist.broadcast_object_list(made, src=0)
    run_dir = Path(made[0])

    try:
        trainer = Trainer(config, run_dir)
        silence_console()
        trainer.step = trainer.checkpoints.resume()
        guard = trainer.skip_guard
        assert guard is not None and trainer.monitor_embedding
        params = sum(p.numel() for p in trainer.model.parameters())  # DTensor numel is the global size

        def set_mode(mode: str) -> None:
            trainer.skip_guard = guard if mode == "on" else None
            trainer.monitor_embedding = mode == "on"

        last = {"norm": 1.0, "embedding_max": None}

        timer = PhaseTimer()
        instrument(trainer, guard, timer)

        def one_step(mode: str) -> tuple[float, float, dict[str, float]]:
            timer.reset()
            result = trainer.train_step()
            report_s = 0.0
            if rank == 0:
                started = time.perf_counter()
                trainer._report(result)
                report_s = time.perf_counter() - started
            phases = [timer.seconds[p] for p in PHASES]
            seconds = torch.tensor([result.seconds, *phases, result.seconds - sum(phases)], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each value: max over ranks
            values = seconds.tolist()
            last["norm"] = result.global_norm
            if mode == "on":
                last["embedding_max"] = trainer.max_embedding_norm
            return values[0], report_s, dict(zip((*PHASES, REST), values[1:]))

        for i in range(args.warmup):
            mode = MODES[i % 2]
            set_mode(mode)
            one_step(mode)
        if rank == 0:
            print(f"warm-up: {args.warmup} steps done", flush=True)

        blocks: list[dict[str, Any]] = []
        for index, mode in enumerate(schedule(args.cycles)):
            set_mode(mode)
            step_s, report_s, phases_s = [], [], []
            for _ in range(args.block):
                s, r, ph = one_step(mode)
                step_s.append(s)
                report_s.append(r)
                phases_s.append(ph)
            blocks.append({"cycle": index // 4, "mode": mode, "step_s": step_s, "report_s": report_s,
                           "phases_s": phases_s})
            if rank == 0:
                print(f"[cycle {index // 4} block {index % 4}] {mode:3s} median step {1e3 * median(step_s):.1f} ms "
                      f"(min {1e3 * min(step_s):.1f}, max {1e3 * max(step_s):.1f})", flush=True)

        set_mode("on")
        trainer._monitored_extras = trainer._monitored_extras.__wrapped__
        guard.decide = guard.decide.__wrapped__
        pieces = time_pieces(trainer, guard, config.guards.skip, last["norm"], last["embedding_max"], args.calls)
        skipped_total = guard.skipped_total
        trainer.checkpoints.close()
        trainer.events.close()
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)

    if rank == 0:
        summary = summarize(blocks)
        meta = {
            "preset": args.preset, "params": params, "world": world, "dp_replicate": args.dp_replicate,
            "dp_shard": args.dp_shard, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
            "block": args.block, "cycles": args.cycles, "warmup": args.warmup, "calls": args.calls,
            "skipped_total": skipped_total, "torch": torch.__version__, "python": platform.python_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - wall_started,
            "targets": {"overhead_max": TARGET_OVERHEAD},
        }
        print_report(summary, pieces, meta)
        print_result("guards (data skip + health) step time, on vs off (s)", summary["rows"]["on"]["step"]["median"],
                     summary["rows"]["off"]["step"]["median"], f"<= {1 + TARGET_OVERHEAD:g} (overhead <= 1 %)",
                     summary["overhead"]["met"], preset=args.preset)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, **summary, "pieces_s": pieces,
                                                   "blocks": blocks}, indent=2) + "\n")
            print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
