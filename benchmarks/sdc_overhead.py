"""Benchmark: step time with SDC detection on every norm layer vs off, same run, interleaved blocks.

How it runs (one process, a 1-rank gloo group made in-process, CPU)::

    python benchmarks/sdc_overhead.py [--preset llama-60m] [--rule v1] [--block 5] [--cycles 3] [--json out.json]

It builds trainguard's real ``Trainer`` (``model.preset=llama-60m``, seq_len 64, micro-batch 1, no
checkpoints) with ``guards.sdc.enabled_level=1`` (detect and log; thresholds at their defaults), so
the trainer makes its ``SdcGuard`` and installs the detection points on all 21 norm layers. Between
blocks it switches detection:

* on:  ``trainer.sdc = guard`` and ``guard.points.install(model, config.points)`` (the hooks back in);
* off: ``trainer.sdc = None`` and ``guard.points.remove()`` (no hook, no identity node, no statistic,
  no ``collect().tolist()``, no rule, no per-rank verdict slot in the all-reduce): the same as a run
  with ``enabled_level=0``.

The detector keeps its state across blocks (it only sees the "on" steps). Blocks of ``--block`` steps
run in ABBA order (off on on off, then on off off on, ...); ``--warmup`` steps (alternating) first are
not counted. The time is ``StepResult.seconds`` of ``Trainer.train_step``. Noise: each mode's blocks
split into interleaved halves A (1st, 3rd, ...) and B (2nd, 4th, ...), compared like on vs off.
Also timed in isolation: the detector's ``detect`` on one step's values, and ``collect().tolist()``.

It is a benchmark: the target (overhead <= 1 %) is reported as met or MISSED, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_OVERHEAD = 0.01
MODES = ("off", "on")

from common import silence_console, median, rel, schedule


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-60m")
    p.add_argument("--rule", default="v1", choices=("v1", "v3"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--block", type=int, default=5, help="steps per block (default 5)")
    p.add_argument("--cycles", type=int, default=3, help="cycles of 4 blocks (default 3: 60 steps per mode at --block 5)")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    import torch
    import torch.distributed as dist

    from trainguard.config import load_config

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    from trainguard.trainer.loop import Trainer

    steps = args.warmup + 4 * args.block * args.cycles
    config = load_config(None, [
        f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
        f"data.micro_batch_size={args.micro_batch_size}", f"train.steps={steps}",
        "checkpoint.save_interval=0", "checkpoint.resume=disable",
        "guards.sdc.enabled_level=1", f"guards.sdc.rule={args.rule}",
    ])
    run_dir = Path(tempfile.mkdtemp(prefix="trainguard-sdc-bench-"))
    try:
        trainer = Trainer(config, run_dir)
        silence_console()
        guard = trainer.sdc
        assert guard is not None
        names = list(guard.points.names)
        params = sum(p.numel() for p in trainer.model.parameters())

        def set_mode(mode: str) -> None:
            if mode == "on" and trainer.sdc is None:
                guard.points.install(trainer.model, guard.config.points)
                assert guard.points.names == names
                trainer.sdc = guard
            elif mode == "off" and trainer.sdc is not None:
                guard.points.remove()
                trainer.sdc = None

        for i in range(args.warmup):
            set_mode(MODES[i % 2])
            trainer.train_step()
        blocks: list[dict[str, Any]] = []
        for index, mode in enumerate(schedule(args.cycles)):
            set_mode(mode)
            times = [trainer.train_step().seconds for _ in range(args.block)]
            blocks.append({"cycle": index // 4, "mode": mode, "step_s": times})
            print(f"[cycle {index // 4} block {index % 4}] {mode:3s} median {1e3 * median(times):.1f} ms", flush=True)

        # pieces in isolation (detection on): the host-side rule, and the one sync
        set_mode("on")
        values = guard.first_values or [1.0] * len(names)
        import copy
        det = copy.deepcopy(guard.detector)
        t = time.perf_counter()
        for i in range(1000):
            det.detect(values, i, names=names)
        detect_s = (time.perf_counter() - t) / 1000
        detections_total = guard.detector.detections_total
        trainer.checkpoints.close()
        trainer.events.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    step = {m: [s for b in blocks if b["mode"] == m for s in b["step_s"]] for m in MODES}
    overhead = rel(median(step["on"]), median(step["off"]))
    halves = {m: ([s for b in [x for x in blocks if x["mode"] == m][0::2] for s in b["step_s"]],
                  [s for b in [x for x in blocks if x["mode"] == m][1::2] for s in b["step_s"]]) for m in MODES}
    noise = {m: rel(median(halves[m][1]), median(halves[m][0])) for m in MODES}
    per_cycle = []
    for c in range(args.cycles):
        on = [s for b in blocks if b["cycle"] == c and b["mode"] == "on" for s in b["step_s"]]
        off = [s for b in blocks if b["cycle"] == c and b["mode"] == "off" for s in b["step_s"]]
        per_cycle.append(rel(median(on), median(off)))
    met = overhead <= TARGET_OVERHEAD
    print(f"\nSDC detection overhead ({args.preset}, {params / 1e6:.1f}M params, rule {args.rule}, "
          f"{len(names)} norm points, seq_len {args.seq_len}, micro-batch {args.micro_batch_size}, 1 rank, "
          f"{torch.get_num_threads()} threads)\n")
    print("| mode | steps | median step ms | p10 | p90 |")
    print("|---|---:|---:|---:|---:|")
    for m in MODES:
        s = sorted(step[m])
        print(f"| {m} | {len(s)} | {1e3 * median(s):.1f} | {1e3 * s[len(s) // 10]:.1f} | "
              f"{1e3 * s[(9 * len(s)) // 10]:.1f} |")
    print(f"\noverhead on vs off: {100 * overhead:+.2f}% (target <= {100 * TARGET_OVERHEAD:.0f}%: "
          f"{'met' if met else 'MISSED'}); per cycle: {', '.join(f'{100 * x:+.2f}%' for x in per_cycle)}")
    print(f"noise (B half vs A half of the same mode): off {100 * noise['off']:+.2f}%, on {100 * noise['on']:+.2f}%")
    print(f"detector.detect on {len(names)} values: {1e6 * detect_s:.1f} us per step; "
          f"detections during the run: {detections_total}")
    meta = {"preset": args.preset, "params": params, "rule": args.rule, "points": len(names),
            "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size, "block": args.block,
            "cycles": args.cycles, "warmup": args.warmup, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - wall}
    print(f"wall time {meta['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": meta, "overhead": overhead, "met": met, "per_cycle": per_cycle, "noise": noise,
            "median_ms": {m: 1e3 * median(step[m]) for m in MODES}, "detect_s": detect_s,
            "detections_total": detections_total, "blocks": blocks}, indent=2) + "\n")
        print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
