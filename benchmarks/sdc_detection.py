"""Benchmark: how many single bit flips in a norm layer's input gradient the SDC rules (v1, v3) detect.

How it runs (one process, no distribution, CPU)::

    python benchmarks/sdc_detection.py [--per-stratum 10] [--steps 420] [--seed 0] [--ratio 0] [--json out.json]

What it does:

* Builds the reference model (``build_model(build_model_config(ModelConfig(preset="llama-micro"), 32),
  seed)``: 2 blocks, 5 RMSNorm layers) and trains it with AdamW (lr 1e-3) on batches of 4 x 32 tokens
  from ``trainguard.trainer.data`` (``TokenDataset`` over the shipped corpus, ``StatefulSampler``,
  ``make_batch``).
* Two ``DetectionPoints`` are installed on every norm layer, one with ``statistic="l2"`` (rule v1), one
  with ``"max_sq"`` (rule v3), and one ``SdcDetector`` per rule with the default thresholds
  (v1: upper (1e6, 1e4), sigma (1e5, 5e3); v3: a1 1e6, a2 100). Before them (so that the points see
  it: full backward hooks run in registration order) the benchmark registers its own full backward
  hook on every norm, which does nothing unless an injection is armed for that norm. ``--ratio R``
  (default 0: off) turns on trainguard's ratio criterion (``guards.sdc.ratio``) in both detectors.
* Every step: a clean forward/backward; each rule judges the 5 points' statistics (that is how the
  detector states are warmed up and advanced, exactly as the trainer does it). After ``--warmup``
  steps every clean verdict counts as a clean check: a level-1 or level-2 verdict there is a false
  positive.
* Injections: ``--per-stratum`` flips for each (dtype, bit class) stratum, shuffled over the steps
  after warm-up. For an injection the step's batch is run forward/backward a second time with one bit
  of one element (random position; ``flip_bit`` moves off a 0.0) of the norm's ``grad_input`` flipped
  by the hook, at a random norm layer. Each rule judges the injected step's statistics with a deep
  copy of its detector as it was *before* the step's clean values (so the injection never enters the
  clean state, and the verdict is the one the trainer would have made at that step). The optimizer
  then steps on the clean gradients.
* dtypes: ``fp32`` flips the fp32 value itself. ``bf16``: the element is cast to bf16, the bit is
  flipped in the bf16 pattern (``flip_bit`` on a bf16 tensor), and the result is cast back to fp32
  into that one element; the rest of the gradient stays fp32. This models a bf16 gradient's storage
  being hit (bit positions of bf16: sign 15, exponent 14..7, mantissa 6..0), while the detector keeps
  the same fp32 history as in the fp32 case.
* Bit classes: the sign bit, each exponent bit (``exp7`` is the top one, ``exp0`` the lowest) and the
  top 3 mantissa bits (``man1`` is the highest). An exponent bit that is already 1 is flipped to 0, so
  the value *shrinks*; that is counted too.
* What the flip did: the factor ``|new / old|`` of the element, and over all parameters' gradients
  ``||g' - g|| / ||g||`` (g: the clean pass's gradients of every parameter, g': the injected pass's;
  with the AdamW/clipping that follow, this is what the update sees). A rerun of the clean pass with
  no flip is checked once to give the same gradients (``rerun_grad_change`` in the output), so any
  change is the flip's.
* A flip *matters* when its factor is >= 1000 or not finite AND it changed the gradients by >= 1e-3
  relative (or made them non-finite). "A flip that changes nothing is not a miss": undetected flips
  that do not matter are reported as harmless misses.

* Ratio headroom (whatever ``--ratio``): for every clean check after warm-up and every injection, the
  benchmark also computes ``(val / max of the point's last 16 clean values) ** (1/e)`` (e = 1 for v1's
  L2 norm, 2 for v3's max(g²)), the quantity the ratio criterion compares with R: the largest clean
  one is how low R can go without a false positive here, the smallest of the flips that mattered how
  high it can go and still catch them all.

Targets (reported met / MISSED, never asserted): every flip with factor >= 1000 detected (level 1 or
2), and 0 false positives over the clean checks, per rule.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

FACTOR_THRESHOLD = 1000.0  # flips that multiply the value by at least this must be detected
GRAD_CHANGE_THRESHOLD = 1e-3  # below this relative change of the gradients, a flip changed nothing
RULES = ("v1", "v3")
DTYPES = ("fp32", "bf16")
STAT_EXPONENT = {"v1": 1, "v3": 2}  # v1's L2 norm scales like the gradient, v3's max(g²) like its square


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-stratum", type=int, default=10, help="injections per (dtype, bit class) (default 10)")
    p.add_argument("--steps", type=int, default=420, help="training steps in all (default 420)")
    p.add_argument("--warmup", type=int, default=20, help="steps before checks and injections count (default 20)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratio", type=float, default=0.0,
                   help="guards.sdc.ratio for both detectors (default 0: off, the rules alone)")
    p.add_argument("--peak", type=float, default=0.5,
                   help="guards.sdc.peak of the v1+peak and v3+peak detectors, judged side by side with the "
                        "rules alone (default 0.5)")
    p.add_argument("--quick", action="store_true", help="a small run: 2 per stratum over 120 steps")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def bit_classes(dtype: str) -> list[tuple[str, int]]:
    """(label, bit position) for the sign, every exponent bit (top first), the top 3 mantissa bits."""
    mantissa = 23 if dtype == "fp32" else 7
    width = 32 if dtype == "fp32" else 16
    classes = [("sign", width - 1)]
    classes += [(f"exp{k}", mantissa + k) for k in range(7, -1, -1)]
    classes += [(f"man{j}", mantissa - j) for j in (1, 2, 3)]
    return classes


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.quick:
        args.per_stratum, args.steps = 2, 120
    started = time.perf_counter()
    import torch
    import torch.nn.functional as F

    from trainguard.config.schema import ModelConfig
    from trainguard.faults.bits import flip_bit
    from trainguard.guards.sdc import DetectionPoints, SdcDetector
    from trainguard.guards.sdc.points import is_norm_module
    from trainguard.trainer.data import (
        StatefulSampler,
        TokenDataset,
        load_corpus_tokens,
        make_batch,
    )
    from trainguard.trainer.model import build_model, build_model_config

    torch.use_deterministic_algorithms(True, warn_only=True)
    model = build_model(build_model_config(ModelConfig(preset="llama-micro"), args.seq_len), args.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    dataset = TokenDataset(load_corpus_tokens(), args.seq_len)
    sampler = StatefulSampler(len(dataset), 0, 1, args.batch, args.seed)

    norms = [(name, m) for name, m in model.named_modules() if is_norm_module(m)]
    armed: dict[str, Any] = {}  # {"module": name, "dtype", "bit", "index"} while an injection is armed
    flips: list[Any] = []

    def inject_hook(name: str, module, grad_input, grad_output):
        if armed.get("module") != name or grad_input[0] is None:
            return None
        g = grad_input[0].detach().clone()
        flat = g.reshape(-1)
        index = armed["index"] % flat.numel()
        if armed["dtype"] == "fp32":
            flip = flip_bit(flat, index, armed["bit"])
        else:
            low = flat.to(torch.bfloat16)
            flip = flip_bit(low, index, armed["bit"])
            flat[flip.index] = low[flip.index].float()
            # old: the fp32 value before the cast, new: what the bf16 flip made of it
            flip = type(flip)(index=flip.index, bit=flip.bit, old=float(grad_input[0].reshape(-1)[flip.index]),
                              new=float(low[flip.index].float()))
        flips.append(flip)
        armed.clear()  # once per injection (a module called once per forward)
        return (g, *grad_input[1:])

    for name, module in norms:  # the points see the flipped gradient whatever the order (docs/sdc.md)
        module.register_full_backward_hook(lambda m, gi, go, _n=name: inject_hook(_n, m, gi, go))
    points = {"v1": DetectionPoints("l2", shares=True), "v3": DetectionPoints("max_sq", shares=True)}
    for p in points.values():
        p.install(model)
    names = points["v1"].names
    assert names == points["v3"].names and len(names) == len(norms), (names, norms)
    # the detectors judged side by side: each rule alone (the reference's semantics, default thresholds)
    # and each rule with the peak criterion; all see the same values
    variants = {rule: (rule, 0.0) for rule in RULES}
    if args.peak:
        variants.update({f"{rule}+peak": (rule, args.peak) for rule in RULES})
    detectors = {v: SdcDetector(rule, names, ratio=args.ratio, peak=peak) for v, (rule, peak) in variants.items()}
    # the ratio headroom: each point's last RATIO_WINDOW values that were not level 1 (the baseline)
    from trainguard.guards.sdc.detectors import RATIO_WINDOW, V1_MIN_STEPS, V3_MIN_STEPS
    min_steps = {"v1": V1_MIN_STEPS, "v3": V3_MIN_STEPS}
    history: dict[str, dict[str, list[float]]] = {rule: {name: [] for name in names} for rule in RULES}

    def headroom(rule: str, name: str, value: float, past: dict[str, dict[str, list[float]]]) -> float | None:
        recent = past[rule][name]
        if len(recent) < min_steps[rule] or max(recent) <= 0:
            return None
        if not math.isfinite(value):
            return math.inf
        return (value / max(recent)) ** (1.0 / STAT_EXPONENT[rule])

    def forward_backward(inputs, labels) -> tuple[float, torch.Tensor, dict[str, tuple[list[float], list[float]]]]:
        optimizer.zero_grad(set_to_none=True)
        for p in points.values():
            p.reset()
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        grads = torch.cat([p.grad.detach().reshape(-1) for p in params if p.grad is not None]).double()
        measured = {rule: tuple(points[rule].collect(with_shares=True).tolist()) for rule in RULES}
        return float(loss.detach()), grads, measured

    eval_inputs, eval_labels = make_batch(dataset, list(range(8)))  # a fixed batch: the loss after an update

    def loss_after_update(grads: dict[torch.Tensor, torch.Tensor]) -> float:
        """The eval batch's loss after one optimizer step on ``grads``; the model and optimizer are
        restored afterwards."""
        saved_params = [p.detach().clone() for p in params]
        saved_optimizer = copy.deepcopy(optimizer.state_dict())
        for p in params:
            p.grad = grads.get(p)
        optimizer.step()
        with torch.no_grad():
            logits = model(input_ids=eval_inputs).logits
            value = float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), eval_labels.reshape(-1)))
        with torch.no_grad():
            for p, saved in zip(params, saved_params):
                p.copy_(saved)
        optimizer.load_state_dict(saved_optimizer)
        return value

    # the injection schedule: stratified, shuffled over the steps after warm-up
    rng = random.Random(args.seed)
    plan = [(dtype, label, bit) for dtype in DTYPES for label, bit in bit_classes(dtype)
            for _ in range(args.per_stratum)]
    rng.shuffle(plan)
    counted_steps = args.steps - args.warmup
    per_step: dict[int, list[tuple[str, str, int]]] = {}
    for i, item in enumerate(plan):
        per_step.setdefault(args.warmup + 1 + (i * counted_steps) // len(plan), []).append(item)

    clean = {v: {"checks": 0, "false_positives": 0, "fp_details": [], "max_headroom": 0.0, "max_share": 0.0}
             for v in variants}
    injections: list[dict[str, Any]] = []
    losses = []
    rerun_change = None
    for step in range(1, args.steps + 1):
        inputs, labels = make_batch(dataset, sampler.next_batch_indices())
        before = {v: copy.deepcopy(detectors[v]) for v in variants} if step in per_step else None
        history_before = copy.deepcopy(history) if step in per_step else None
        loss, grads, measured = forward_backward(inputs, labels)
        losses.append(loss)
        for v, (rule, _) in variants.items():
            values, shares = measured[rule]
            found = detectors[v].detect(values, step, shares=shares)
            if step > args.warmup:
                clean[v]["checks"] += sum(1 for x in values if x >= 0)
                clean[v]["false_positives"] += len(found)
                clean[v]["max_share"] = max([clean[v]["max_share"]] + [x for x in shares if math.isfinite(x)])
                clean[v]["fp_details"] += [
                    {"step": step, "point": d.point, "level": d.level, "value": d.value, "reason": d.reason}
                    for d in found]
            if v != rule:
                continue
            alarmed = {d.point for d in found if d.level == 1}
            for name, value in zip(names, values):
                if value < 0:
                    continue
                room = headroom(rule, name, value, history)
                if step > args.warmup and room is not None:
                    clean[v]["max_headroom"] = max(clean[v]["max_headroom"], room)
                if name not in alarmed and math.isfinite(value):
                    history[rule][name] = (history[rule][name] + [value])[-RATIO_WINDOW:]
        clean_grads = {p: p.grad.detach().clone() for p in params if p.grad is not None}
        if step in per_step:
            clean_eval_loss = loss_after_update(clean_grads)
            if rerun_change is None:
                _, again, _ = forward_backward(inputs, labels)
                rerun_change = float((again - grads).norm() / grads.norm())
        for dtype, label, bit in per_step.get(step, []):
            target = rng.randrange(len(names))
            armed.update(module=names[target], dtype=dtype, bit=bit, index=rng.randrange(1 << 30))
            _, flipped_grads, flipped = forward_backward(inputs, labels)
            assert not armed, "the injection hook did not fire"
            flip = flips[-1]
            factor = abs(flip.new / flip.old) if flip.old != 0 else math.inf
            finite = bool(torch.isfinite(flipped_grads).all())
            change = float((flipped_grads - grads).norm() / grads.norm()) if finite else math.inf
            norm_change = float((flipped_grads.norm() - grads.norm()).abs() / grads.norm()) if finite else math.inf
            eval_loss = loss_after_update({p: p.grad.detach().clone() for p in params if p.grad is not None})
            loss_change = abs(eval_loss - clean_eval_loss) / clean_eval_loss if math.isfinite(eval_loss) else math.inf
            record = {"step": step, "dtype": dtype, "class": label, "bit": flip.bit, "point": names[target],
                      "old": flip.old, "new": flip.new, "factor": factor, "grad_change": change,
                      "grad_norm_change": norm_change, "loss_change": loss_change,
                      "share": flipped["v1"][1][target], "clean_share": measured["v1"][1][target]}
            for rule in RULES:
                value, clean_value = flipped[rule][0][target], measured[rule][0][target]
                # the factor of the point's statistic, in its own units (v1: L2 norm, v3: max(g²))
                record[f"{rule}_stat_factor"] = (value / clean_value if clean_value > 0 and math.isfinite(value)
                                                 else math.inf)
            for v, (rule, _) in variants.items():
                judge = copy.deepcopy(before[v])
                values, shares = flipped[rule]
                found = [d for d in judge.detect(values, step, shares=shares) if d.point == names[target]]
                # against the history before this step's clean values, as the judging detector
                room = headroom(rule, names[target], values[target], history_before)
                record[v] = {"level": min((d.level for d in found), default=0),
                             "reason": found[0].reason if found else "",
                             "value": values[target], "clean_value": measured[rule][0][target], "headroom": room}
            injections.append(record)
        # back to the clean gradients for the update
        for p in params:
            p.grad = clean_grads.get(p)
        optimizer.step()

    summary = summarize(injections, clean, list(variants))
    meta = {"preset": "llama-micro", "norm_points": names, "steps": args.steps, "warmup": args.warmup,
            "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed,
            "per_stratum": args.per_stratum, "injections": len(injections), "rerun_grad_change": rerun_change,
            "loss_first": losses[0], "loss_last": losses[-1], "torch": torch.__version__,
            "python": platform.python_version(), "ratio": args.ratio,
            "peak": args.peak, "variants": list(variants), "wall_s": time.perf_counter() - started,
            "targets": {"factor_threshold": FACTOR_THRESHOLD, "grad_change_threshold": GRAD_CHANGE_THRESHOLD}}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **summary, "injections": injections}, indent=2,
                                              default=str) + "\n")
        print(f"wrote {args.json}")
    print_report(summary, meta)
    return 0


def big(r: dict[str, Any]) -> bool:
    """The flip multiplied the element by >= 1000 (or made it non-finite)."""
    return r["factor"] >= FACTOR_THRESHOLD or not math.isfinite(r["factor"])


def big_statistic(r: dict[str, Any], rule: str) -> bool:
    """The flip multiplied the point's statistic (the rule's value) by >= 1000 (or made it non-finite)."""
    return r[f"{rule}_stat_factor"] >= FACTOR_THRESHOLD


def matters(r: dict[str, Any]) -> bool:
    return big(r) and (r["grad_change"] >= GRAD_CHANGE_THRESHOLD)


def fmt_factor(x: float) -> str:
    if not math.isfinite(x):
        return "inf/nan"
    if x == 0:
        return "0"
    return f"2^{math.log2(x):.0f}" if abs(math.log2(x)) >= 4 else f"{x:.3g}"


def summarize(injections: list[dict[str, Any]], clean: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    strata: list[tuple[str, str]] = []
    for r in injections:
        if (r["dtype"], r["class"]) not in strata:
            strata.append((r["dtype"], r["class"]))
    order = {label: i for i, (label, _) in enumerate(bit_classes("fp32"))}
    strata.sort(key=lambda k: (DTYPES.index(k[0]), order[k[1]]))
    rows = []
    for dtype, label in strata:
        mine = [r for r in injections if r["dtype"] == dtype and r["class"] == label]
        factors = [r["factor"] for r in mine]
        finite = [f for f in factors if math.isfinite(f)]
        row = {"dtype": dtype, "class": label, "bit": mine[0]["bit"], "injections": len(mine),
               "factor_min": min(finite) if finite else math.inf, "factor_max": max(factors),
               "non_finite": len(factors) - len(finite), "big": sum(1 for r in mine if big(r)),
               "max_grad_change": max(r["grad_change"] for r in mine),
               "max_loss_change": max(r["loss_change"] for r in mine)}
        for v in variants:
            missed = [r for r in mine if r[v]["level"] == 0]
            row[v] = {"detected": len(mine) - len(missed), "level1": sum(1 for r in mine if r[v]["level"] == 1),
                      "big_detected": sum(1 for r in mine if big(r) and r[v]["level"] > 0),
                      "misses_that_mattered": sum(1 for r in missed if matters(r)),
                      "max_grad_change_of_misses": max((r["grad_change"] for r in missed), default=0.0),
                      "max_loss_change_of_misses": max((r["loss_change"] for r in missed), default=0.0)}
        rows.append(row)
    targets = {}
    for v in variants:
        rule = v.split("+")[0]
        bigs = [r for r in injections if big(r)]
        stat_bigs = [r for r in injections if big_statistic(r, rule)]
        fp = clean[v]["false_positives"]
        reasons: dict[str, int] = {}
        for r in injections:
            if r[v]["level"]:
                reasons[r[v]["reason"]] = reasons.get(r[v]["reason"], 0) + 1
        missed_big = [r for r in bigs if r[v]["level"] == 0]
        rooms = [r[v]["headroom"] for r in injections if matters(r) and r[v]["headroom"] is not None]
        targets[v] = {
            "big_flips": len(bigs), "big_detected": len(bigs) - len(missed_big),
            "detect_big_met": not missed_big,
            "stat_big_flips": len(stat_bigs), "stat_big_detected": sum(1 for r in stat_bigs if r[v]["level"] > 0),
            "misses_that_mattered": sum(1 for r in injections if r[v]["level"] == 0 and matters(r)),
            "missed_big": [{k: r[k] for k in ("step", "dtype", "class", "point", "factor", "grad_change",
                                               "loss_change", "share", f"{rule}_stat_factor")} for r in missed_big],
            "clean_checks": clean[v]["checks"], "false_positives": fp, "false_positives_met": fp == 0,
            "fp_details": clean[v]["fp_details"][:20], "max_clean_share": clean[v]["max_share"],
            "max_clean_headroom": clean[v]["max_headroom"],
            "min_headroom_of_flips_that_mattered": min(rooms, default=math.inf),
            "flips_that_mattered": sum(1 for r in injections if matters(r)),
            "detection_reasons": reasons,
        }
    shares = [r["share"] for r in injections if big(r) and math.isfinite(r["share"])]
    return {"rows": rows, "targets": targets, "min_share_of_finite_big_flips": min(shares, default=math.nan)}


def print_report(summary: dict[str, Any], meta: dict[str, Any]) -> None:
    variants = meta["variants"]
    print(f"\nSDC detection of single bit flips in norm-layer input gradients ({meta['preset']}, "
          f"{len(meta['norm_points'])} norm points, {meta['injections']} injections judged by each detector, "
          f"{meta['steps']} steps, loss {meta['loss_first']:.3f} -> {meta['loss_last']:.3f})\n")
    print("| dtype | bits | bit | inj | factor range | ≥1000× | " + " | ".join(f"{v} detected" for v in variants)
          + " | max grad change | max loss change | " + " | ".join(f"{v} max loss change of a miss" for v in variants)
          + " |")
    print("|---|---|---:|---:|---|---:|" + "---:|" * (2 * len(variants) + 2))
    for r in summary["rows"]:
        rng = f"{fmt_factor(r['factor_min'])} .. {fmt_factor(r['factor_max'])}"
        if r["non_finite"]:
            rng += f" ({r['non_finite']} inf)"
        detected = " | ".join(f"{r[v]['detected']}" for v in variants)
        loss_misses = " | ".join(f"{r[v]['max_loss_change_of_misses']:.2g}" for v in variants)
        print(f"| {r['dtype']} | {r['class']} | {r['bit']} | {r['injections']} | {rng} | {r['big']} | {detected} | "
              f"{r['max_grad_change']:.2g} | {r['max_loss_change']:.2g} | {loss_misses} |")
    print()
    for v, t in summary["targets"].items():
        big_ = "met" if t["detect_big_met"] else "MISSED"
        fp = "met" if t["false_positives_met"] else "MISSED"
        print(f"{v}: flips ×≥{FACTOR_THRESHOLD:g} (element) detected {t['big_detected']}/{t['big_flips']}: {big_}; "
              f"flips ×≥{FACTOR_THRESHOLD:g} (the point's statistic) detected {t['stat_big_detected']}/"
              f"{t['stat_big_flips']}; misses that mattered {t['misses_that_mattered']}; false positives "
              f"{t['false_positives']}/{t['clean_checks']} clean checks: {fp}; by reason {t['detection_reasons']}")
        for m in t["missed_big"]:
            print(f"    missed: step {m['step']} {m['dtype']} {m['class']} at {m['point']}: element ×{fmt_factor(m['factor'])}, "
                  f"statistic ×{m[v.split('+')[0] + '_stat_factor']:.3g}, share {m['share']:.3f}, "
                  f"gradients changed {m['grad_change']:.3g}, eval loss after the update changed {m['loss_change']:.3g}")
    print(f"largest clean peak share: {max(t['max_clean_share'] for t in summary['targets'].values()):.3f}; "
          f"smallest share of a finite ≥1000× flip: {summary['min_share_of_finite_big_flips']:.3f}")
    print(f"ratio criterion (guards.sdc.ratio) = {meta['ratio']:g}" + (" (off)" if not meta["ratio"] else ""))
    for rule in RULES:
        t = summary["targets"][rule]
        print(f"{rule}: ratio headroom: largest clean {t['max_clean_headroom']:.3g}, smallest of the "
              f"{t['flips_that_mattered']} flips that mattered {t['min_headroom_of_flips_that_mattered']:.3g}")
    print(f"clean rerun's gradient change (determinism check): {meta['rerun_grad_change']}")
    print(f"\nwall time {meta['wall_s']:.1f} s")
    for v in variants:
        if "+" not in v:
            continue
        rule, t, alone = v.split("+")[0], summary["targets"][v], summary["targets"][v.split("+")[0]]
        rate = t["big_detected"] / t["big_flips"] if t["big_flips"] else 1.0
        alone_rate = alone["big_detected"] / alone["big_flips"] if alone["big_flips"] else 1.0
        print("RESULT " + json.dumps({
            "figure": f"sdc {v} (peak {meta['peak']:g}): share of flips x>=1000 detected",
            "trainguard": rate, "baseline": alone_rate, "ratio": rate / alone_rate if alone_rate else None,
            "target": "1.0 (every flip x>=1000 detected)", "met": t["detect_big_met"]}))
        print("RESULT " + json.dumps({
            "figure": f"sdc {v} (peak {meta['peak']:g}): false positives over {t['clean_checks']} clean checks",
            "trainguard": t["false_positives"], "baseline": alone["false_positives"], "ratio": None,
            "target": "0", "met": t["false_positives_met"]}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
