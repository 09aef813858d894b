"""Benchmark: the cost of the extra detection points and of replica fingerprints, side by side.

How it runs (one process, CPU)::

    python benchmarks/detection_overhead.py [--preset llama-60m] [--pairs 20] [--interval 50] [--quick] [--json out.json]

It builds the reference model (``--preset``, seq_len 64, micro-batch 1) with AdamW and times training
steps (forward, backward, the rule on the step's values, optimizer step) in two modes, alternating in
ABBA pairs after ``--warmup`` steps, so that both see the same load on a shared machine:

* ``norms``: detection points on every norm layer's input gradient (the points before this change);
* ``all``: the default set now: those, every transformer block's output gradient
  (``guards.sdc.blocks``) and every parameter's gradient (``guards.sdc.gradients``).

The extra points' overhead is the median over the pairs of ``all / norms - 1``.

Fingerprints (``guards.fingerprint``): between the steps of every pair, the time of one fingerprint
of the whole state (``local_state`` of the model and AdamW, ``fingerprints``, one ``.tolist()``: what
a check costs besides its all-gather of ``[tensors, 3]`` int64 values) and of one non-finite scan
(``nonfinite_state``, done before every save). A fingerprint step costs two hashes (after the update
before it, and the check), so the per-step overhead at interval K is ``2 x hash / K`` over the median
step. Per save: one hash and one scan.

Targets (printed, never asserted): each overhead <= 1 % of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

TARGET = 0.01


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-60m")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--interval", type=int, default=None, help="guards.fingerprint.interval (default: the config's)")
    p.add_argument("--quick", action="store_true", help="8 pairs after 2 warm-up steps")
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.quick:
        args.pairs, args.warmup = 8, 2
    import torch
    import torch.nn.functional as F

    from trainguard.config.schema import ModelConfig
    from trainguard.guards.fingerprint import DEFAULT_INTERVAL, fingerprints
    from trainguard.guards.sdc import DetectionPoints, GradientPoints, SdcConfig, SdcDetector
    from trainguard.guards.state_health import local_state, nonfinite_state
    from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
    from trainguard.trainer.model import build_model, build_model_config

    interval = args.interval or DEFAULT_INTERVAL
    started = time.perf_counter()
    model = build_model(build_model_config(ModelConfig(preset=args.preset), args.seq_len), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = TokenDataset(load_corpus_tokens(), args.seq_len)
    sampler = StatefulSampler(len(dataset), 0, 1, 1, 0)
    peak = SdcConfig().peak
    points = DetectionPoints("l2", shares=True)
    gradients = GradientPoints(model, "l2", shares=True)
    norm_names = points.install(model)
    all_names = points.install(model, blocks=True) + gradients.names
    detectors = {"norms": SdcDetector("v1", norm_names, peak=peak), "all": SdcDetector("v1", all_names, peak=peak)}

    def step(mode: str) -> float:
        points.install(model, blocks=(mode == "all"))
        inputs, labels = make_batch(dataset, sampler.next_batch_indices())
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1)).backward()
        parts = [points.collect(with_shares=True)]
        if mode == "all":
            parts.append(gradients.collect(with_shares=True))
        values, shares = torch.cat(parts, dim=1).tolist()
        detectors[mode].detect(values, 0, shares=shares)
        optimizer.step()
        return time.perf_counter() - t

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for i in range(args.warmup):
        step(("norms", "all")[i % 2])
    pairs, hashes, scans = [], [], []
    for i in range(args.pairs):
        pair = {}
        for mode in (("norms", "all") if i % 2 == 0 else ("all", "norms")):
            pair[mode] = step(mode)
        pairs.append(pair)
        hashes.append(timed(lambda: fingerprints(local_state(model, optimizer)).tolist()))
        scans.append(timed(lambda: nonfinite_state(local_state(model, optimizer))))
    points.remove()
    ratios = [p["all"] / p["norms"] - 1 for p in pairs]
    step_s = statistics.median(p["norms"] for p in pairs)
    extra = statistics.median(ratios)
    hash_s, scan_s = statistics.median(hashes), statistics.median(scans)
    fingerprint = 2 * hash_s / interval / step_s
    params = sum(p.numel() for p in model.parameters())
    wall = time.perf_counter() - started
    print(f"Detection overhead ({args.preset}, {params / 1e6:.1f}M params, seq_len {args.seq_len}, micro-batch 1, "
          f"CPU, {torch.get_num_threads()} threads, {args.pairs} ABBA pairs; {wall:.0f} s)\n")
    print("| what | median | share of the step | target |")
    print("|---|---:|---:|---|")
    print(f"| step, norm points only | {1e3 * step_s:.0f} ms | | |")
    print(f"| step, default points ({len(all_names)}: {len(norm_names)} norm, "
          f"{len(all_names) - len(norm_names) - len(gradients.names)} block, {len(gradients.names)} gradient) | "
          f"{1e3 * statistics.median(p['all'] for p in pairs):.0f} ms | {100 * extra:+.2f} % (median of pair ratios) | "
          f"{'met' if extra <= TARGET else 'MISSED'} |")
    print(f"| one fingerprint of the state (params + AdamW) | {1e3 * hash_s:.1f} ms | "
          f"{100 * fingerprint:.3f} % per step at interval {interval} (2 per check) | "
          f"{'met' if fingerprint <= TARGET else 'MISSED'} |")
    print(f"| non-finite scan before a save | {1e3 * scan_s:.1f} ms | {100 * scan_s / step_s:.2f} % of one step, per save | |")
    print(f"\npair ratios p25 {100 * statistics.quantiles(ratios, n=4)[0]:+.2f} %, "
          f"p75 {100 * statistics.quantiles(ratios, n=4)[2]:+.2f} %")
    result = {"preset": args.preset, "params": params, "pairs": pairs, "extra_points_overhead": extra,
              "hash_s": hash_s, "scan_s": scan_s, "interval": interval, "fingerprint_overhead": fingerprint,
              "points": {"norms": len(norm_names), "all": len(all_names)}, "wall_s": wall}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=1)
    print("RESULT " + json.dumps({"figure": f"extra detection points, {args.preset}", "ratio": 1 + extra,
                                  "target": "<= 1.01", "met": extra <= TARGET}))
    print("RESULT " + json.dumps({"figure": f"fingerprints at interval {interval}, {args.preset}",
                                  "ratio": 1 + fingerprint, "target": "<= 1.01", "met": fingerprint <= TARGET}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
