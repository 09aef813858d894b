"""Benchmark: how the SDC rules' sensitivity to one bit flip changes with a detection point's size.

How it runs (one process, CPU, no model)::

    python benchmarks/sdc_sensitivity.py [--sizes 8192,131072,2097152,33554432] [--steps 400] [--seed 0] [--quick]
        [--width 4096] [--heavy]

A norm layer's input gradient has hidden-size x tokens elements: 8k on a toy model, 33M on a 70B
model (8192 x 4096 tokens). The larger the point, the less one corrupted element moves the point's
L2 norm: a x2^16 flip of an element of typical size z (in units of the gradient's RMS) raises it by
``sqrt(1 + z² 2^32 / n)``, only about 11 |z| at n = 2^25.

What it does, per size n:

* One real gradient-like vector ``base`` of n elements is drawn (standard normal; ``--heavy`` draws
  Student-t with 3 degrees of freedom instead: heavier tails, as real gradients have).
* A point's clean value at step t is ``base`` scaled by ``sigma_t``: a log-space AR(1) process
  (``log sigma_t = 0.9 log sigma_{t-1} + N(0, 0.2)``, about 40 % step-to-step spread) with a slow
  decay (gradients shrink during training). So the statistics the rules see are exactly those of the
  scaled vector: its L2 norm (v1), its max(g²) (v3) and its peak share, judged against its row as
  the activation points do (``isolated_peak_share``; rows of ``--width`` elements, a token's features).
* Each of 4 detectors (v1, v3, each alone and with the peak criterion at ``--peak``) judges every
  clean step; after ``--warmup`` steps each clean verdict counts as a clean check (a detection there
  is a false alarm), and at every step the same values with one element of ``base`` flipped are
  judged by a copy of the detector as it was before the step (so flips never enter the clean state).
  The statistics of the flipped vector are computed exactly from the clean ones and the one element.
* Flip classes: ``x2^16`` (the element multiplied by 2^16: the exponent bit that a value of moderate
  size has at 0) and ``x2^128``-class (``top``: the top exponent bit of an fp32 value below 2, which
  makes it about 1e38 or Inf). Every flip here changes the point's gradient by more than 0.1 % (it
  "matters" by the measure of ``sdc_detection.py``) unless the element was close to 0: those
  (``rel change < 1e-3``) are reported apart and not counted as misses.

Reported: per size and detector, the share of flips detected (level 1 or 2) and the false alarms over
the clean checks. Targets (printed, never asserted): ≥ 95 % of flips that matter detected at every
size, 0 false alarms.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

DETECTORS = ("v1", "v3", "v1+peak", "v3+peak")
FLIP_FACTOR = {"x2^16": 2.0 ** 16, "top": 2.0 ** 126}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8192,131072,2097152,33554432", help="elements per point, comma-separated")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--peak", type=float, default=None, help="guards.sdc.peak (default: SdcConfig's)")
    p.add_argument("--rms", type=float, default=1e-4, help="the elements' RMS at step 0 (default 1e-4)")
    p.add_argument("--width", type=int, default=4096, help="elements per row (a token's features; the peak share "
                   "is judged against its row as the activation points do; default 4096, a 70B model's hidden size)")
    p.add_argument("--heavy", action="store_true", help="Student-t(3) elements instead of normal ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="150 steps, sizes 8k and 2M")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def run_size(n: int, args: argparse.Namespace) -> dict:
    import torch

    from trainguard.guards.sdc import SdcDetector

    generator = torch.Generator().manual_seed(args.seed + n)
    if args.heavy:
        torch.manual_seed(args.seed + n)  # the distribution samples from the global generator
        base = torch.distributions.StudentT(3.0).sample((n,)).float()
    else:
        base = torch.randn(n, generator=generator)
    squares = base.double().square()
    total = float(squares.sum())
    largest = float(squares.max())
    rows = squares.reshape(-1, args.width).sum(dim=1)  # each row's energy (a token's features)
    peak_row = int(squares.argmax()) // args.width
    rng = torch.Generator().manual_seed(args.seed * 7919 + n)

    def share_of(total_sq: float, max_sq: float, row_rest: float) -> float:
        """The isolated peak share (``isolated_peak_share``): the rest of the point counts at least as
        much as the rest of the peak's row would if every row were like it."""
        rest = max(total_sq - max_sq, len(rows) * row_rest)
        return max_sq / (max_sq + rest) if max_sq + rest > 0 else 0.0

    def stats(total_sq: float, max_sq: float, row_rest: float, scale: float) -> tuple[float, float, float]:
        return math.sqrt(total_sq) * scale, max_sq * scale * scale, share_of(total_sq, max_sq, row_rest)

    clean_rest = float(rows[peak_row]) - largest

    detectors = {
        "v1": SdcDetector("v1", ["p"]), "v3": SdcDetector("v3", ["p"]),
        "v1+peak": SdcDetector("v1", ["p"], peak=args.peak), "v3+peak": SdcDetector("v3", ["p"], peak=args.peak),
    }
    false_alarms = {name: 0 for name in detectors}
    caught = {(flip, name): 0 for flip in FLIP_FACTOR for name in detectors}
    mattered = {flip: 0 for flip in FLIP_FACTOR}
    harmless = {flip: 0 for flip in FLIP_FACTOR}
    checks = 0
    log_sigma = 0.0
    for step in range(args.steps):
        log_sigma = 0.9 * log_sigma + 0.2 * float(torch.randn((), generator=rng))
        scale = args.rms * math.exp(log_sigma) * (1.0 - 0.5 * step / args.steps)
        l2, max_sq, share = stats(total, largest, clean_rest, scale)
        counted = step >= args.warmup
        if counted:
            index = int(torch.randint(n, (), generator=rng))
            element = float(squares[index])
            for flip, factor in FLIP_FACTOR.items():
                flipped_total = total + element * (factor * factor - 1.0)
                row = index // args.width
                if element * factor * factor > largest:  # the flipped element is the peak: its row's rest
                    f_peak, f_rest = element * factor * factor, float(rows[row]) - element
                else:  # the clean peak stays, its row's rest grown by the flip if it is the same row
                    f_peak = largest
                    f_rest = clean_rest + (element * (factor * factor - 1.0) if row == peak_row else 0.0)
                f_l2, f_max, f_share = stats(flipped_total, f_peak, f_rest, scale)
                change = math.sqrt(element) * (factor - 1.0) / math.sqrt(total)
                if change < 1e-3:
                    harmless[flip] += 1
                    continue
                mattered[flip] += 1
                for name, detector in detectors.items():
                    value = f_l2 if name.startswith("v1") else f_max
                    if not math.isfinite(value):
                        value = math.inf
                    if copy.deepcopy(detector).detect([value], step, shares=[f_share]):
                        caught[(flip, name)] += 1
        for name, detector in detectors.items():
            value = l2 if name.startswith("v1") else max_sq
            if detector.detect([value], step, shares=[share]) and counted:
                false_alarms[name] += 1
        checks += counted
    return {
        "n": n, "checks": checks, "false_alarms": false_alarms,
        "detected": {f"{flip}/{name}": caught[(flip, name)] for flip, name in caught},
        "mattered": mattered, "harmless": harmless,
        "clean_share": share_of(total, largest, clean_rest),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.peak is None:
        from trainguard.guards.sdc import SdcConfig

        args.peak = SdcConfig().peak
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(size % args.width for size in sizes):
        print(f"error: --width {args.width} must divide every size in --sizes {args.sizes}", file=sys.stderr)
        return 2
    if args.quick:
        args.steps, sizes = 150, [8192, 2097152]
    started = time.perf_counter()
    results = [run_size(n, args) for n in sizes]
    print(f"SDC rule sensitivity by point size ({'Student-t(3)' if args.heavy else 'normal'} elements, "
          f"{args.steps} steps, warm-up {args.warmup}, peak {args.peak}); {time.perf_counter() - started:.1f} s")
    header = "| elements per point | flip | " + " | ".join(DETECTORS) + " | false alarms (v1, v3, v1+peak, v3+peak) |"
    print(header)
    print("|" + "---|" * (3 + len(DETECTORS)))
    for r in results:
        for flip in FLIP_FACTOR:
            cells = [f"{r['detected'][f'{flip}/{name}']}/{r['mattered'][flip]}" for name in DETECTORS]
            alarms = ", ".join(str(r["false_alarms"][name]) for name in DETECTORS)
            print(f"| {r['n']:,} | {flip} | " + " | ".join(cells) + f" | {alarms} of {r['checks']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)
    largest = results[-1]
    for name in ("v1+peak", "v3+peak"):
        rate = largest["detected"][f"x2^16/{name}"] / largest["mattered"]["x2^16"]
        alone = largest["detected"][f"x2^16/{name.split('+')[0]}"] / largest["mattered"]["x2^16"]
        print("RESULT " + json.dumps({
            "figure": f"sdc {name}: share of x2^16 flips detected at {largest['n']:,} elements per point",
            "trainguard": rate, "baseline": alone, "ratio": rate / alone if alone else None,
            "target": ">= 0.95", "met": rate >= 0.95}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
