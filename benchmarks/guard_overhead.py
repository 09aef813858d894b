"""Benchmark: ``guard.step`` against the same loop with plain ``clip_grad_norm_`` + ``optimizer.step()``.

How it runs: under ``torchrun``, one process per rank (2 by default: FSDP2 over ``dp_shard``), gloo on CPU::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/guard_overhead.py [--preset llama-60m] [--cycles 6] [--block 2] [--quick]

Started without torchrun it re-executes itself under ``torch.distributed.run`` (``--ranks``, default 2).

One model (the reference trainer's ``llama-60m`` preset by default, built from its config; ``--quick``:
``llama-tiny``), one AdamW and one LR schedule are stepped by three loops in turn, in blocks of
``--block`` steps, each cycle rotating which goes first (plain, guard, guard+SDC; then guard, guard+SDC,
plain; ...), so every mode sees the same machine state:

* plain: ``zero_grad``, forward + backward, ``torch.nn.utils.clip_grad_norm_``, ``optimizer.step()``,
  ``scheduler.step()``: what a user's loop does without trainguard;
* guard: ``guard.should_stop`` + ``guard.step(closure)`` with every guard but SDC on: data skip, checkpoint
  health with the embedding norm measured every step (``guards.monitor``), heartbeats, the lifecycle
  (time limit armed), thresholds no step reaches; checkpoints off in every mode (their cost is the
  ``ckpt_save`` benchmark's);
* guard+SDC: the same with ``guards.sdc.enabled_level: 2`` (v1 rule and peak criterion on every norm
  layer); its hooks are installed only while its blocks run. Its share is reported separately.

Each step is timed on every rank and the maximum over ranks kept (an all-reduce outside the timed
region). Noise: the plain blocks are split into two interleaved halves and compared with each other.

It is a benchmark: the target (guard overhead <= 1 % of the plain step) is reported as met or missed,
never asserted. The last lines are ``RESULT {...}`` for ``benchmarks/run_all``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import median, print_result, rel, relaunch_under_torchrun, silence_console

TARGET_OVERHEAD = 0.01
MODES = ("plain", "guard", "guard+sdc")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="model.preset (default llama-60m; --quick: llama-tiny)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--cycles", type=int, default=None, help="rotations of the three modes (default 6; --quick 3)")
    p.add_argument("--block", type=int, default=2, help="steps per block (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="ranks when it starts torchrun itself (default 2)")
    p.add_argument("--quick", action="store_true", help="llama-tiny, 3 cycles")
    args = p.parse_args(argv)
    args.preset = args.preset or ("llama-tiny" if args.quick else "llama-60m")
    args.cycles = args.cycles or (3 if args.quick else 6)
    return args


def rotation(cycles: int) -> list[str]:
    """Each cycle runs every mode once, the starting mode rotating so none always runs first."""
    return [MODES[(c + i) % len(MODES)] for c in range(cycles) for i in range(len(MODES))]


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "RANK" not in os.environ:
        relaunch_under_torchrun(args.ranks, __file__)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import trainguard
    from trainguard.config import load_config
    from trainguard.config.schema import ModelConfig
    from trainguard.trainer.model import build_model, build_model_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = build_model(build_model_config(ModelConfig(preset=args.preset), args.seq_len), seed=0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(vocab, (args.micro_batch_size, args.seq_len + 1), generator=gen)

    def forward_backward() -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        return loss

    common = ["checkpoint.save_interval=0", "checkpoint.resume=disable", "guards.skip.enabled=true",
              "guards.skip.threshold=1e9", "guards.health.enabled=true", "guards.health.embedding_threshold=1e9",
              "guards.monitor=true", "lifecycle.exit_duration_in_mins=100000", "train.log_interval=1000000",
              # the three modes step one model in turn, so each guard finds it changed since its own last
              # update: the every-step at-rest check would (rightly) call that a flip; its cost is
              # detection_overhead.py's "at-rest check every step" row
              "guards.fingerprint.at_rest=interval"]
    scratch = Path(tempfile.mkdtemp(prefix="guard_overhead_")) if rank == 0 else None
    box = [str(scratch)]
    dist.broadcast_object_list(box, src=0)
    guards = {
        "guard": trainguard.Guard(Path(box[0]) / "guard", model, optimizer, scheduler=scheduler,
                                  config=load_config(None, common), mesh=mesh),
        "guard+sdc": trainguard.Guard(Path(box[0]) / "sdc", model, optimizer, scheduler=scheduler,
                                      config=load_config(None, common + ["guards.sdc.enabled_level=2"]), mesh=mesh),
    }
    silence_console()
    steps = {name: guard.resume() for name, guard in guards.items()}
    sdc_points = guards["guard+sdc"].sdc.points
    sdc_points.remove()  # installed only while guard+sdc runs

    def plain_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()

    def guarded_step(name: str) -> None:
        guard = guards[name]
        guard.should_stop(steps[name], 10**9)
        steps[name] = guard.step(forward_backward).step

    def run(mode: str, count: int) -> list[float]:
        if mode == "guard+sdc":
            sdc_points.install(model, guards[mode].config.guards.sdc.points)
        seconds = []
        for _ in range(count):
            dist.barrier()
            started = time.perf_counter()
            plain_step() if mode == "plain" else guarded_step(mode)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds.append(float(elapsed))
        if mode == "guard+sdc":
            sdc_points.remove()
        return seconds

    for mode in MODES:
        run(mode, args.warmup)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    plain_halves: tuple[list[float], list[float]] = ([], [])
    for index, mode in enumerate(rotation(args.cycles)):
        block = run(mode, args.block)
        times[mode] += block
        if mode == "plain":
            plain_halves[(index // len(MODES)) % 2].extend(block)

    if rank == 0:
        plain, guard, sdc = (median(times[m]) for m in MODES)
        noise = rel(median(plain_halves[1]), median(plain_halves[0]))
        overhead, sdc_share = rel(guard, plain), (sdc - guard) / plain
        print(f"guard.step overhead: {args.preset}, seq {args.seq_len}, micro-batch {args.micro_batch_size}, "
              f"{world} ranks FSDP2 (gloo, CPU), {args.cycles} cycles x {len(MODES)} modes x {args.block} steps")
        print(f"{'mode':<12}{'steps':>7}{'median step (ms)':>19}{'vs plain':>11}")
        for mode in MODES:
            print(f"{mode:<12}{len(times[mode]):>7}{median(times[mode]) * 1e3:>19.1f}"
                  f"{rel(median(times[mode]), plain) * 100:>+10.2f}%")
        print(f"noise (plain vs plain, interleaved halves): {noise * 100:+.2f}%")
        print(f"every guard but SDC: {overhead * 100:+.2f}% of the plain step (target <= {TARGET_OVERHEAD:.0%}: "
              f"{'met' if overhead <= TARGET_OVERHEAD else 'missed'}); SDC's share on top: {sdc_share * 100:+.2f}%")
        print_result(f"guard.step overhead, every guard but SDC ({args.preset})", guard, plain,
                     f"<= {TARGET_OVERHEAD:.0%} over plain clip_grad_norm_ + optimizer.step()",
                     overhead <= TARGET_OVERHEAD, overhead=overhead, noise=noise)
        print_result(f"guard.step SDC share ({args.preset})", sdc, guard, "reported, no target", True,
                     share_of_plain_step=sdc_share)
    for guard in guards.values():
        guard.close()
    dist.destroy_process_group()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
