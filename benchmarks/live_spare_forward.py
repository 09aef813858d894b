"""What a warm spare's first step costs when its warm-up skipped the model's own forward.

A warm spare started through ``guard.resume()`` has no micro-batch loss yet: it warms the autograd
engine (a backward of the parameters' squares) and the optimizer (a step) on a copy of the model
(``LiveRank.warm_up``), not the model's forward. Its first step's micro-batches then run the forward
cold, while the survivors wait for it in the step's reduction. Measured here, in fresh processes (a
spare is one), for the reference trainer's model (``--preset``), three warm-ups side by side:

- ``engine``: today's (the autograd engine and the optimizer);
- ``dummy``: the same plus a forward and backward of the model's ``dummy_inputs`` (Hugging Face's) on
  the copy, its RNG forked (the candidate for ``guard.resume()``'s spares);
- ``loss``: the first real micro-batch on the copy (what a spare started by ``guard.step(loss_of)``
  does): the bound.

Each trial is one process: imports, model, optimizer, data (not timed), the warm-up (timed), then three
micro-batches of a later step (each timed: forward, loss, backward), as the replacement's first step
computes them. ``cold`` is the first one's time less the third's. Variants take turns trial by trial.
Figures and the conclusion (it does not pay on CPU: not added): benchmarks/README.md.

Usage: python benchmarks/live_spare_forward.py [--quick] [--trials N] [--preset NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, print_result  # noqa: E402

VARIANTS = ("engine", "dummy", "loss")
MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN, SEED = 4, 2, 32, 0


def trial(variant: str, preset: str) -> dict:
    import copy

    import torch

    from trainguard.config import load_config
    from trainguard.live.micro_batch import micro_batch_grad
    from trainguard.trainer.data import StatefulSampler, TokenDataset, load_corpus_tokens, make_batch
    from trainguard.trainer.model import build_model, build_model_config, token_cross_entropy
    from trainguard.trainer.optim import build_optimizer

    config = load_config(None, [f"model.preset={preset}", f"data.seq_len={SEQ_LEN}",
                                f"data.micro_batch_size={MICRO_BATCH_SIZE}"])
    model = build_model(build_model_config(config.model, max_position_embeddings=SEQ_LEN), seed=SEED)
    optimizer, _ = build_optimizer(model, config.optim, 8)
    dataset = TokenDataset(load_corpus_tokens(), SEQ_LEN)
    order = StatefulSampler(len(dataset), dp_rank=0, dp_size=1, micro_batch_size=MICRO_BATCH_SIZE, seed=SEED)

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        first = (step * MICRO_BATCHES + micro_batch) * MICRO_BATCH_SIZE
        inputs, labels = make_batch(dataset, order.peek_global_indices(first, MICRO_BATCH_SIZE))
        return token_cross_entropy(model(input_ids=inputs).logits, labels)

    began = time.perf_counter()
    warm_model, warm_optimizer = copy.deepcopy((model, optimizer))
    if variant == "loss":
        micro_batch_grad(warm_model, loss_of, 0, 0, MICRO_BATCHES, SEED)
    else:
        sum(p.square().sum() for p in warm_model.parameters()).backward()
        if variant == "dummy":
            with torch.random.fork_rng():
                warm_model(**warm_model.dummy_inputs).logits.float().sum().backward()
    warm_optimizer.step()
    warm_s = time.perf_counter() - began
    times = []
    for micro_batch in range(3):
        began = time.perf_counter()
        micro_batch_grad(model, loss_of, 5, micro_batch, MICRO_BATCHES, SEED)
        times.append(time.perf_counter() - began)
    return {"variant": variant, "warm_s": warm_s, "first_s": times[0], "cold_s": times[0] - times[2]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trials", type=int, default=None, help="processes per variant (default 12, 4 quick)")
    parser.add_argument("--preset", default="llama-micro")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(trial(args.trial, args.preset)), flush=True)
        return
    trials = args.trials or (4 if args.quick else 12)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(trials):
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, __file__, "--trial", variant, "--preset", args.preset], env=env,
                                  capture_output=True, text=True, check=True)
            results[variant].append(json.loads(done.stdout.splitlines()[-1]))
    print(f"warm spare's first micro-batch after its warm-up ({args.preset}, seq {SEQ_LEN}, micro-batch "
          f"{MICRO_BATCH_SIZE}; {trials} processes per variant, medians; load {os.getloadavg()[0]:.1f})")
    print(f"{'warm-up':<8} {'warm-up s':>10} {'1st micro-batch ms':>19} {'cold extra ms':>14}")
    figures = {}
    for variant in VARIANTS:
        rows = results[variant]
        figures[variant] = {key: median([row[key] for row in rows]) for key in ("warm_s", "first_s", "cold_s")}
        row = figures[variant]
        print(f"{variant:<8} {row['warm_s']:>10.4f} {row['first_s'] * 1e3:>19.2f} {row['cold_s'] * 1e3:>14.2f}")
    # the first micro-batch less the third, per process: what the cold forward adds, less of the load's noise
    saved = figures["engine"]["cold_s"] - figures["dummy"]["cold_s"]
    print_result(f"live spare: cold extra of its first micro-batch, dummy-forward warm-up vs today's ({args.preset}, s)",
                 figures["dummy"]["cold_s"], figures["engine"]["cold_s"],
                 "pays when it saves >= 10 ms (what the survivors' pause at a join would show)", saved >= 0.01,
                 saved_s=saved, loss_warmed_cold_s=figures["loss"]["cold_s"])

if __name__ == "__main__":
    main()
