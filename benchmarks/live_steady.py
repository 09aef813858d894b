"""Live mode's steady-state cost against plain HSDP of the same model, with no failure (issue 35, item 6).

Side by side in one invocation, 4 gloo ranks on this machine as 2 replica groups x 2, the example's model
(``examples/user_model.py``: a 2-layer GPT-2), the same global batch (``--micro-batches``), steps and
clipping (1.0), in ABC CBA order over ``--cycles``:

- plain HSDP: ``examples/user_loop_plain.py --replicate 2`` under ``torchrun``: ``fully_shard`` over a
  (dp_replicate=2, dp_shard=2) mesh, AdamW, no trainguard;
- live: ``examples/user_loop.py`` under ``trainguard run --nproc 4`` with ``fault_tolerance.live: true``,
  the layout 2 x 2 and nothing else on (no durable save, ``guards.fingerprint.interval: 0``; data skip and
  SDC detection are off by default): the quorum, the order-fixed sum and the row-sharded parameters;
- live FSDP2: the same with ``fault_tolerance.fsdp: true``: the example shards its model with ``fully_shard``
  over its replica group's mesh (``trainguard.data_parallel_mesh()``), one reduce-scatter per group share on
  the epoch's group and the group partials added in group order.

Each run's rank 0 prints one line per step; a step's time is the gap between two such lines as they
arrive here (the same measure for both), and a run's steady rate is one over the median gap after the
first ``WARMUP`` steps (the start, imports and the first compilations left out). Target: live within 5 %
of plain's steps/s. ``--base-src DIR`` adds a fourth arm, live FSDP2 run on another tree's ``src`` (for
example ``git archive main src | tar -x -C DIR``), a before/after in the same cycles.
Usage: ``python benchmarks/live_steady.py [--quick] [--cycles 2] [--base-src DIR]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, print_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
WORLD, REPLICATE = 4, 2
WARMUP = 3
TARGET = 0.95  # live's steps/s over plain's
STEP_LINE = re.compile(rb"^step (\d+) loss ")


def step_gaps(command: list[str], env: dict[str, str]) -> list[float]:
    """Runs ``command`` and returns the gaps between rank 0's consecutive step lines, in arrival order."""
    arrivals = []
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT) as proc:
        for line in proc.stdout:
            if STEP_LINE.match(line):
                arrivals.append(time.perf_counter())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {proc.returncode}")
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def plain(run_dir: Path, steps: int, micro_batches: int, env: dict[str, str]) -> list[float]:
    return step_gaps([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                      str(EXAMPLES / "user_loop_plain.py"), "--run-dir", str(run_dir), "--steps", str(steps),
                      "--micro-batches", str(micro_batches), "--replicate", str(REPLICATE)], env)


def live(run_dir: Path, steps: int, micro_batches: int, env: dict[str, str], fsdp: bool = False) -> list[float]:
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(f"parallel: {{dp_replicate: {REPLICATE}, dp_shard: {WORLD // REPLICATE}}}\n"
                      f"train: {{steps: {steps}, micro_batches: {micro_batches}}}\n"
                      "checkpoint: {save_interval: 0}\nguards: {fingerprint: {interval: 0}}\n"
                      f"fault_tolerance: {{live: true, fsdp: {str(fsdp).lower()}}}\n")
    return step_gaps([sys.executable, "-m", "trainguard", "run", "--nproc", str(WORLD), "--config", str(config),
                      "--run-dir", str(run_dir), "--", sys.executable, str(EXAMPLES / "user_loop.py"), "--config",
                      str(config)], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of each of 16 steps")
    parser.add_argument("--cycles", type=int, default=2, help="ABC CBA cycles (6 runs each)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--base-src", type=Path, help="also run live FSDP2 on this trainguard source tree")
    args = parser.parse_args()
    steps = 16 if args.quick else args.steps
    modes = ["plain", "live", "live FSDP2"] + (["live FSDP2 base"] if args.base_src else [])
    order = modes if args.quick else [m for _ in range(args.cycles) for m in modes + modes[::-1]]

    def env_of(src: Path) -> dict[str, str]:
        return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(EXAMPLES), str(src), os.environ.get("PYTHONPATH", "")]))

    env = env_of(ROOT / "src")
    runs = {"plain": plain, "live": live, "live FSDP2": partial(live, fsdp=True)}
    if args.base_src:
        runs["live FSDP2 base"] = lambda run_dir, steps, micro_batches, _env: live(
            run_dir, steps, micro_batches, env_of(args.base_src.resolve()), fsdp=True)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="live_steady_") as tmp:
        for index, mode in enumerate(order):
            gaps = runs[mode](Path(tmp) / f"{mode.replace(' ', '_')}{index}", steps, args.micro_batches, env)[WARMUP:]
            rates[mode].append(1.0 / median(gaps))
            print(f"  run {index + 1}/{len(order)} {mode}: {rates[mode][-1]:.2f} steps/s "
                  f"(median of {len(gaps)} step gaps)", flush=True)
    plain_rate, live_rate, fsdp_rate = (median(rates[mode]) for mode in modes[:3])
    ratio = live_rate / plain_rate
    print(f"\nsteady state, {WORLD} gloo ranks ({REPLICATE} replica groups x {WORLD // REPLICATE}), {steps} steps of "
          f"{args.micro_batches} micro-batches, no failure; medians over {len(rates['plain'])} run(s) each\n")
    print(f"| {'run':<10} | {'steps/s':>8} | {'step time':>10} | {'/ plain':>7} |")
    print(f"|{'-' * 12}|{'-' * 10}|{'-' * 12}|{'-' * 9}|")
    names = {"plain": "plain HSDP", "live FSDP2 base": f"live FSDP2 on {args.base_src}"}
    for mode in modes:
        rate = median(rates[mode])
        print(f"| {names.get(mode, mode):<10} | {rate:>8.2f} | {1000 / rate:>8.1f} ms | {rate / plain_rate:>7.3f} |")
    print(f"\nlive / plain steps/s: {ratio:.3f} (target ≥ {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    print_result("live_steady_steps_per_s", live_rate, plain_rate, f">= {TARGET}x plain HSDP", ratio >= TARGET,
                 steps=steps, micro_batches=args.micro_batches, runs=len(order))
    print_result("live_fsdp2_steady_steps_per_s", fsdp_rate, plain_rate, f">= {TARGET}x plain HSDP",
                 fsdp_rate / plain_rate >= TARGET, steps=steps, micro_batches=args.micro_batches, runs=len(order))


if __name__ == "__main__":
    main()
