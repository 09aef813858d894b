"""Benchmark: checkpoints that do not stall training (lazy snapshot, memory tier), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/nostall.py [--preset llama-60m] [--cycles 1] [--quick] [--dir /tmp]
        [--only blocked throughput kill]

On 2 ranks (FSDP2 over a 1-D gloo mesh, AdamW, a Llama built from a trainguard preset, random tokens):

1. *blocked time per save* (after one untimed save of each kind): an async durable save (``CheckpointManager.save_durable``: the copy of the
   state runs in the background) blocks the loop for the time ``save_durable`` takes plus what is left
   of the copy when the next optimizer step starts (``wait_for_staging``, measured after the next
   forward and backward), against a synchronous save of the same state (``async_save=False``, until
   committed). Maximum over ranks, median of ``--saves`` saves. Target: ≤ 0.01 × sync.
2. *throughput*: training steps per second with a durable async save every 10 steps, and with the
   memory tier every step (``checkpoint.memory_interval=1``, ``/dev/shm``), against no saves; blocks
   of 20 steps, each timed until its saves are committed, each mode in ABBA quads with blocks without
   saves (none X X none, X none none X); the figure is the median over quads of each quad's ratio.
   Targets: ≥ 0.97 and ≥ 0.95.
3. *steps redone after a SIGKILL*: ``trainguard train`` with the memory tier every step, rank 1 killed
   (SIGKILL) as it starts step K, restarted with ``--resume auto``: the step it resumes from, and
   whether every step's loss equals a run without the kill (bitwise). Target: ≤ 1 step redone.

Figures 1 and 2 are measured for each ``checkpoint.writer`` (``thread``: the save's background thread;
``process``: a writer process per rank and tier), side by side; figure 2 also prints, per step, the
seconds the loop spent in ``save()`` and in ``wait_for_staging()``, and the median time the memory
tier took to write a step's files (its ``local_saved`` events).

``--quick``: llama-tiny, fewer saves and steps. Numbers from a shared, loaded machine are noisy: the
ratios are measured side by side in one run. It is a benchmark: targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median, print_result

TARGET_BLOCKED = 0.01
TARGET_DURABLE = 0.97
TARGET_MEMORY = 0.95
FIGURES = ("blocked", "throughput", "kill")
WRITERS = ("thread", "process")  # checkpoint.writer, side by side
BLOCK = 20
DURABLE_INTERVAL = 10


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-60m", help="model preset (default llama-60m)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--saves", type=int, default=3, help="saves timed per path for figure 1 (default 3)")
    p.add_argument("--cycles", type=int, default=1, help="ABBA cycles for figure 2 (default 1)")
    p.add_argument("--kill-step", type=int, default=9, help="figure 3: rank 1 is killed as it starts this step")
    p.add_argument("--dir", default=None, help="where checkpoints go (a temporary directory inside; default /tmp)")
    p.add_argument("--quick", action="store_true", help="llama-tiny, 2 saves, seq 64")
    p.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES), help="figures to measure (default all)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.saves, args.seq_len, args.kill_step = "llama-tiny", 2, 64, 7
    return args


# ------------------------------------------------------------------------------- under torchrun
def build(args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainguard.trainer.model import PRESETS

    torch.manual_seed(0)
    config = LlamaConfig(**PRESETS[args.preset], max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = config.vocab_size

    def forward_backward() -> None:
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len))
        model(input_ids=tokens, labels=tokens).loss.backward()

    def train_step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # the optimizer state exists from here on
    return model, optimizer, forward_backward, train_step


def max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def inner(args) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.events import EventLog
    from trainguard.step.local_tier import build_memory_tier

    logging_quiet()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    root = Path(args.dir)
    shm = Path("/dev/shm") / f"trainguard-bench-{os.getppid()}"
    model, optimizer, forward_backward, train_step = build(args)
    state_bytes = sum(p.to_local().nbytes for p in model.parameters()) * 3
    total_bytes = int(max_over_ranks(state_bytes)) * 2

    blocked = "blocked" in args.only
    # 1. blocked time per save, for each writer (checkpoint.writer), against a sync save
    sync = CheckpointManager(root / "sync", model, optimizer, async_save=False, keep_last=1)
    lazy = {writer: CheckpointManager(root / f"lazy-{writer}", model, optimizer, keep_last=1,
                                      config=CheckpointConfig(save_interval=0, writer=writer)) for writer in WRITERS}
    sync_s: list[float] = []
    call_s: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    wait_s: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    blocked_s: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    step = 0
    for round in range(args.saves + 1 if blocked else 0):  # round 0 warms up (the first save allocates and plans)
        step += 1
        train_step()
        dist.barrier()
        started = time.perf_counter()
        sync.save_durable(step)
        sync.close()
        if round:
            sync_s.append(max_over_ranks(time.perf_counter() - started))
        for writer, manager in lazy.items():
            dist.barrier()
            started = time.perf_counter()
            manager.save_durable(step)
            call = time.perf_counter() - started
            forward_backward()  # the next step's forward and backward: the copy (and the write) run meanwhile
            waited = manager.wait_for_staging()
            optimizer.step()
            optimizer.zero_grad()
            manager.close()
            samples = [max_over_ranks(call), max_over_ranks(waited), max_over_ranks(call + waited)]
            if round:
                for values, sample in zip((call_s[writer], wait_s[writer], blocked_s[writer]), samples):
                    values.append(sample)

    # 2. throughput, with each writer; the memory tier's cost in the loop broken down
    managers: dict[str, CheckpointManager | None] = {"none": None}
    for writer in WRITERS:
        durable_config = CheckpointConfig(save_interval=DURABLE_INTERVAL, keep_last=2, writer=writer)
        managers[f"durable10-{writer}"] = CheckpointManager(root / f"durable-{writer}", model, optimizer,
                                                           config=durable_config)
    for writer in WRITERS:
        memory_config = CheckpointConfig(save_interval=0, memory_interval=1, memory_dir=str(shm / writer / "node{node}"),
                                         writer=writer)
        run_dir = root / f"memory-{writer}"
        events = EventLog(run_dir / "events.jsonl", rank=rank, host="bench")
        memory_tier = build_memory_tier(run_dir, memory_config, mesh_shape=(2,), mesh_dim_names=("dp_shard",),
                                        ranks_per_node=2, model=model, events=events)
        managers[f"memory1-{writer}"] = CheckpointManager(run_dir, model, optimizer, config=memory_config,
                                                         memory=memory_tier, events=events)
    rates: dict[str, list[float]] = {mode: [] for mode in managers}
    in_save: dict[str, list[float]] = {mode: [] for mode in managers}
    in_wait: dict[str, list[float]] = {mode: [] for mode in managers}
    step = DURABLE_INTERVAL // 2  # durable saves fall inside blocks, not at their ends
    # each mode against no saves in ABBA quads (none X X none, then X none none X), so that the load of
    # a shared machine, which drifts over minutes, weighs on both sides of each ratio alike
    order: list[tuple[str, int]] = []
    for cycle in range(args.cycles if "throughput" in args.only else 0):
        for mode in [m for m in managers if m != "none"]:
            quad = ["none", mode, mode, "none"] if cycle % 2 == 0 else [mode, "none", "none", mode]
            order += [(m, len(order) // 4) for m in quad]
    warmup = [(mode, -1) for mode in managers] if order else []  # one untimed block of each mode first
    quads: dict[int, dict[str, list[float]]] = {}
    for index, (mode, quad_id) in enumerate(warmup + order):
        timed = index >= len(warmup)
        manager = managers[mode]
        dist.barrier()
        started = time.perf_counter()
        saving = waiting = 0.0
        for _ in range(BLOCK):
            step += 1
            forward_backward()
            if manager is not None:
                waiting += manager.wait_for_staging()
            optimizer.step()
            optimizer.zero_grad()
            if manager is not None:
                begun = time.perf_counter()
                manager.save(step)
                saving += time.perf_counter() - begun
        if manager is not None:
            manager.close()  # the block's saves are committed within its time
        elapsed = max_over_ranks(time.perf_counter() - started)
        if timed:
            rates[mode].append(BLOCK / elapsed)
            quads.setdefault(quad_id, {}).setdefault(mode, []).append(BLOCK / elapsed)
            in_save[mode].append(max_over_ranks(saving) / BLOCK)
            in_wait[mode].append(max_over_ranks(waiting) / BLOCK)
    shutil.rmtree(shm, ignore_errors=True)

    if rank == 0:
        print(f"\nstate: {args.preset}, {total_bytes / 1e9:.3f} GB (model + AdamW) over 2 ranks; "
              f"seq {args.seq_len} x batch {args.batch} per rank; load average at the end "
              f"{os.getloadavg()[0]:.2f}\n")
        print("| figure | median | samples |\n|---|---:|---|")
        if blocked:
            print(f"| sync save, until committed (s) | {median(sync_s):.3f} | {', '.join(f'{x:.3f}' for x in sync_s)} |")
            for writer in WRITERS:
                for label, values in (("save_durable()", call_s[writer]),
                                      ("wait_for_staging() after forward+backward", wait_s[writer]),
                                      ("blocked in all", blocked_s[writer])):
                    print(f"| lazy async save, writer {writer}: {label} (s) | {median(values):.4f} | "
                          f"{', '.join(f'{x:.4f}' for x in values)} |")
        if "throughput" in args.only:
            for mode, values in rates.items():
                print(f"| steps/s, {mode} | {median(values):.3f} | {', '.join(f'{x:.3f}' for x in values)} |")
            for mode in managers:
                if mode != "none":
                    print(f"| {mode}: per step in save() / in wait_for_staging() (ms) | "
                          f"{1000 * median(in_save[mode]):.2f} / {1000 * median(in_wait[mode]):.2f} | |")
            print("\nmemory tier, per step (ms, rank 0): " + "; ".join(
                f"{writer}: {memory_profile(root / f'memory-{writer}')}" for writer in WRITERS))
        print()
        if blocked:
            for writer in WRITERS:
                value = median(blocked_s[writer])
                print_result(f"blocked time per async save vs sync save (s), writer {writer}", value, median(sync_s),
                             f"ratio <= {TARGET_BLOCKED}", value <= TARGET_BLOCKED * median(sync_s))
        if "throughput" in args.only:
            for writer in WRITERS:
                for mode, target, label in ((f"durable10-{writer}", TARGET_DURABLE, "durable async save every 10 steps"),
                                            (f"memory1-{writer}", TARGET_MEMORY, "memory tier every step")):
                    ratios = [statistics.mean(q[mode]) / statistics.mean(q["none"]) for q in quads.values() if mode in q]
                    value = median(ratios)
                    print(f"{mode}: ratios of its ABBA quads {', '.join(f'{r:.3f}' for r in ratios)}")
                    print_result(f"steps/s with a {label} vs no saves, writer {writer} (median of ABBA quad ratios)",
                                 value * median(rates["none"]), median(rates["none"]), f"ratio >= {target}",
                                 value >= target)
    dist.barrier()
    dist.destroy_process_group()


def memory_profile(run_dir: Path) -> str:
    """The memory tier's write of a step, from its ``local_saved`` events: the rank's files written
    and committed (in the writer process or the background thread)."""
    lines = (run_dir / "events.jsonl").read_text().splitlines() if (run_dir / "events.jsonl").exists() else []
    seconds = [e["seconds"] for e in map(json.loads, lines)
               if e.get("kind") == "local_saved" and e.get("tier") == "memory" and e.get("rank", 0) == 0]
    return f"files written in {1000 * median(seconds):.1f} (median of {len(seconds)})"


def logging_quiet() -> None:
    import logging

    logging.getLogger("trainguard").setLevel(logging.WARNING)


# ----------------------------------------------------------------------------- the orchestrator
def steps_redone(args, work: Path) -> None:
    """Figure 3, through ``trainguard train`` (a kill needs real processes and a restart)."""
    steps = args.kill_step + 3
    common = ["--nproc", "2", "--steps", str(steps), "--save-interval", "0", "--set", f"model.preset={args.preset}",
              "--set", f"data.seq_len={args.seq_len}", "--set", f"data.micro_batch_size={args.batch}"]
    memory = ["--set", "checkpoint.memory_interval=1",
              "--set", f"checkpoint.memory_dir=/dev/shm/trainguard-bench-{os.getpid()}/{{run}}/node{{node}}"]
    env = dict(os.environ, TRAINGUARD_FAULTS=f"kill:rank=1,step={args.kill_step}")

    def train(run_dir: Path, *extra: str, faults: bool = False) -> int:
        return subprocess.run([sys.executable, "-m", "trainguard", "train", "--run-dir", str(run_dir), *common, *extra],
                              env=env if faults else dict(os.environ), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode

    try:
        clean, killed = work / "clean", work / "killed"
        codes = [train(clean), train(killed, *memory, faults=True), train(killed, *memory, faults=True)]
    finally:
        shutil.rmtree(f"/dev/shm/trainguard-bench-{os.getpid()}", ignore_errors=True)

    def read(run_dir: Path, kind: str) -> list[dict]:
        lines = (run_dir / "events.jsonl").read_text().splitlines() if (run_dir / "events.jsonl").exists() else []
        return [e for e in (json.loads(line) for line in lines if line.strip()) if e.get("kind") == kind]

    started = read(killed, "run_started")
    resumed = started[-1]["step"] if len(started) >= 2 else None
    completed = args.kill_step - 1
    redone = completed - resumed if resumed is not None else float("nan")
    losses = {e["step"]: e["loss"] for e in read(clean, "step")}
    after = {e["step"]: e["loss"] for e in read(killed, "step")}
    bitwise = bool(losses) and losses == after
    tier = started[-1].get("tier") if started else None
    print(f"\nkill: exit codes {codes} (clean, killed, restarted); killed as step {args.kill_step} started, "
          f"{completed} steps completed; resumed from step {resumed} (tier {tier}); steps redone {redone}; "
          f"every step's loss equal to the clean run: {bitwise}\n")
    print_result("steps redone after a SIGKILL with the memory tier every step", float(redone), 1.0,
                 "redone <= 1 and losses bitwise equal", redone <= 1 and bitwise and codes[0] == 0 and codes[2] == 0)


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.inner:
        inner(args)
        return
    work = Path(tempfile.mkdtemp(prefix="nostall-", dir=args.dir))
    try:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        inner_args = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                      "--saves", str(args.saves), "--cycles", str(args.cycles), "--only", *args.only,
                      "--inner", "--dir", str(work)]
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               os.path.abspath(__file__), *inner_args], env=env).returncode
        if code != 0:
            sys.exit(code)
        if "kill" in args.only:
            steps_redone(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
