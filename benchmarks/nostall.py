"""Benchmark: checkpoints that do not stall training (lazy snapshot, memory tier), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/nostall.py [--preset llama-60m] [--cycles 1] [--quick] [--dir /tmp]
        [--seq-len 128] [--batch 2] [--only blocked throughput kill profile] [--writers thread process]

On 2 ranks (``--ranks``; FSDP2 over a 1-D gloo mesh, or NCCL with ``--device cuda``; AdamW, a Llama built
from a trainguard preset, random tokens):

1. *blocked time per save* (after one untimed save of each kind): an async durable save (``CheckpointManager.save_durable``: the copy of the
   state runs in the background) blocks the loop for the time ``save_durable`` takes (the wait for the previous
   save to commit included: saves are not closed between rounds) plus what is left
   of the copy when the next optimizer step starts (``wait_for_staging``, measured after the next
   forward and backward), against a synchronous save of the same state (``async_save=False``, until
   committed). Maximum over ranks, median of ``--saves`` saves. Target: ≤ 0.01 × sync.
2. *throughput*: training steps per second with a durable async save every 10 steps (``--durable-every``:
   other intervals, ``auto`` the most frequent one the disk sustains, printed beside Young/Daly's), and
   with the memory tier every step (``checkpoint.memory_interval=1``, ``/dev/shm``; a save that finds
   the previous write running is skipped: the share of steps saved is printed and in the RESULT line),
   against no saves; blocks of ``--block`` steps (20), each timed until its last step is done (a run
   goes on past a block: the wait for its saves to commit comes after the timer and is printed), each
   mode in ABBA quads with blocks without saves (none X X none, X none none X); the figure is the median
   over quads of each quad's ratio, and beside it the ratio of the fastest block of each mode
   (interference only slows a block). A save still committing when the next is due is waited for
   inside that ``save()``, within the block's time. Targets: ≥ 0.97 and ≥ 0.95.
3. *steps redone after a SIGKILL*: ``trainguard train`` with the memory tier every step, rank 1 killed
   (SIGKILL) as it starts step K, restarted with ``--resume auto``: the step it resumes from, and
   whether every step's loss equals a run without the kill (bitwise). Target: ≤ 1 step redone.

4. *where the CPU goes* (``--only profile``): the CPU time, per rank, of one durable async save and of
   one memory-tier step, the training thread idle meanwhile (the save, then ``close()``; the memory
   tier's save, then its wait): the training process (capture, the copy into staging, DCP's planning
   and collectives, the commit) and, with ``writer process``, the writer process (serialisation,
   hashing, file writes, fsync; ``/proc/<pid>/stat``, averaged over the saves); then the pieces of that
   work on this rank's own staged bytes, one thread: the memcpy, xxh3_64 (the manifest's checksum),
   ``os.write`` into a new file and over an existing one, ``write_records`` (a DCP shard's
   serialisation, hashing, write and fsync); and the step time without saves, with the CPU a save may
   take for the targets on a machine whose cores the ranks keep busy (0.03 x 10 steps, 0.05 x 1 step).

5. *where the wall time goes* (``--only trace``): a few memory-tier steps (every step) and one durable
   async save, writer ``thread``, under ``torch.profiler`` (CPU and CUDA; a Chrome trace per run in
   ``--trace-dir``) with ``cProfile`` on the thread that writes the files (its top functions printed, the
   whole profile saved beside the traces); each step's wall time split into forward and backward, the
   wait for the copy, the optimizer step and ``save()``; and the pieces a memory-tier step may cost on
   the rank's state: the device-to-host copy into page-locked memory (wall), xxh3_64 on one thread and
   in 64 MiB pieces on several.

Figures 1, 2 and 4 are measured for each ``checkpoint.writer`` (``thread``: the save's background thread;
``process``: a writer process per rank and tier), side by side; figure 2 also prints, per step, the
seconds the loop spent in ``save()`` and in ``wait_for_staging()``, and the median time the memory
tier took to write a step's files (its ``local_saved`` events).

``--quick``: llama-tiny, fewer saves and steps. Numbers from a shared, loaded machine are noisy: the
ratios are measured side by side in one run. It is a benchmark: targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import abba_quad, median, print_result

TARGET_BLOCKED = 0.01
TARGET_DURABLE = 0.97
TARGET_MEMORY = 0.95
FIGURES = ("blocked", "throughput", "kill", "profile", "trace")
WRITERS = ("thread", "process")  # checkpoint.writer, side by side
BLOCK = 20
DURABLE_INTERVAL = 10
MTBF_HOURS = 54 * 24 * 16384 / 419 / 1024


def add_model_arguments(p: argparse.ArgumentParser, preset: str) -> None:
    """The model and the tokens of a step: ``--preset``, ``--seq-len``, ``--batch`` (what ``build`` reads)."""
    p.add_argument("--preset", default=preset, help=f"model preset (default {preset})")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "llama-60m")
    p.add_argument("--saves", type=int, default=3, help="saves timed per path for figure 1 (default 3)")
    p.add_argument("--cycles", type=int, default=1, help="ABBA cycles for figure 2 (default 1)")
    p.add_argument("--block", type=int, default=BLOCK, help=f"steps per timed block of figure 2 (default {BLOCK}; "
                   "raised to twice the largest --durable-every, so that each block holds two durable saves)")
    p.add_argument("--durable-every", nargs="*", default=[str(DURABLE_INTERVAL)],
                   help=f"figure 2's durable save intervals in steps (default {DURABLE_INTERVAL}); 'auto': the most "
                   "frequent one this disk sustains, 1.25 x the synchronous save's time in steps; none: no durable mode")
    p.add_argument("--mtbf-hours", type=float, default=MTBF_HOURS,
                   help=f"the job's mean time between failures for Young/Daly's interval (default {MTBF_HOURS}: "
                   "Llama 3 405B's 419 unexpected interruptions in 54 days on 16,384 GPUs, for a 1,024-GPU job)")
    p.add_argument("--kill-step", type=int, default=9, help="figure 3: rank 1 is killed as it starts this step")
    p.add_argument("--dir", default=None, help="where checkpoints go (a temporary directory inside; default /tmp)")
    p.add_argument("--quick", action="store_true", help="llama-tiny, 2 saves, seq 64")
    p.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES), help="figures to measure (default all)")
    p.add_argument("--writers", nargs="+", choices=WRITERS, default=list(WRITERS),
                   help="checkpoint.writer values measured (default both)")
    p.add_argument("--ranks", type=int, default=2, help="ranks on this machine (default 2; 1 for one GPU: NCCL "
                   "refuses two ranks on one device)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains (cuda: NCCL, pinned staging buffers, the copy on a side stream)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1; more on a host with "
                   "cores to spare, where the ranks would take one core each too slowly)")
    p.add_argument("--trace-dir", default=None, help="figure 5 (--only trace): where the torch profiler's traces "
                   "and the writers' CPU profiles go (default: the work directory, removed at the end)")
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
    where = device(args)
    config = LlamaConfig(**PRESETS[args.preset], max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(where)
    mesh = init_device_mesh(args.device, (args.ranks,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = config.vocab_size

    def forward_backward() -> None:
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len), device=where)
        model(input_ids=tokens, labels=tokens).loss.backward()

    def train_step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # the optimizer state exists from here on
    return model, optimizer, forward_backward, train_step


def device(args):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def durable_intervals(args, model, optimizer, train_step, root: Path) -> list[int]:
    """Figure 2's durable intervals (``--durable-every``): ``auto`` from a synchronous save's time and a
    step's, measured here; prints them beside Young/Daly's interval for ``--mtbf-hours``."""
    import math

    import torch.distributed as dist

    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.plan.interval import optimal_save_interval

    train_step()
    settle(args)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(5):
        train_step()
    settle(args)
    step_s = max_over_ranks((time.perf_counter() - started) / 5)
    sync = CheckpointManager(root / "sync-interval", model, optimizer, async_save=False, keep_last=1)
    save_s = []
    for step in (1, 2):  # the first allocates and plans
        started = time.perf_counter()
        sync.save_durable(step)
        sync.close()
        save_s.append(max_over_ranks(time.perf_counter() - started))
    sustained = max(1, math.ceil(1.25 * save_s[-1] / step_s))
    young_daly = optimal_save_interval(save_s[-1], args.mtbf_hours * 3600) / step_s
    if dist.get_rank() == 0:
        print(f"durable intervals: a step {1000 * step_s:.1f} ms, a synchronous save {save_s[-1]:.3f} s: the most "
              f"frequent interval this disk sustains (1.25 x the save) {sustained} steps; Young/Daly for an MTBF of "
              f"{args.mtbf_hours:.1f} h (sqrt(2 x save x MTBF)) {young_daly:.0f} steps", flush=True)
    return sorted({sustained if every == "auto" else int(every) for every in args.durable_every})


def skipped_of(memory) -> int:
    """The memory tier's saves skipped so far (0 without one; a tree from before the skip counts none:
    ``--base-src`` runs)."""
    return getattr(memory, "skipped", 0) if memory is not None else 0


def device_fields(args) -> dict[str, str]:
    """What a RESULT line says of where it was measured: the device, and a GPU's name."""
    import torch

    return {"device": "cuda", "gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {"device": "cpu"}


def settle(args) -> None:
    """Waits for the work enqueued on the GPU, so that a wall-clock reading includes it."""
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


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
    from trainguard.checkpoint.local.in_place import MAPPED
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.events import EventLog
    from trainguard.step.local_tier import build_memory_tier

    logging_quiet()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("cpu:gloo,cuda:nccl")  # the timings' reductions stay on the CPU
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    root = Path(args.dir)
    shm = Path("/dev/shm") / f"trainguard-bench-{os.getppid()}"
    model, optimizer, forward_backward, train_step = build(args)
    state_bytes = sum(p.to_local().nbytes for p in model.parameters()) * 3
    total_bytes = int(max_over_ranks(state_bytes)) * args.ranks

    blocked = "blocked" in args.only
    # 1. blocked time per save, for each writer (checkpoint.writer), against a sync save
    sync = CheckpointManager(root / "sync", model, optimizer, async_save=False, keep_last=1)
    lazy = {writer: CheckpointManager(root / f"lazy-{writer}", model, optimizer, keep_last=1,
                                      config=CheckpointConfig(save_interval=0, writer=writer)) for writer in args.writers}
    sync_s: list[float] = []
    call_s: dict[str, list[float]] = {writer: [] for writer in args.writers}
    wait_s: dict[str, list[float]] = {writer: [] for writer in args.writers}
    blocked_s: dict[str, list[float]] = {writer: [] for writer in args.writers}
    step = 0
    for round in range(args.saves + 1 if blocked else 0):  # round 0 warms up (the first save allocates and plans)
        step += 1
        train_step()
        settle(args)
        dist.barrier()
        started = time.perf_counter()
        sync.save_durable(step)
        sync.close()
        if round:
            sync_s.append(max_over_ranks(time.perf_counter() - started))
        for writer, manager in lazy.items():
            settle(args)
            dist.barrier()
            started = time.perf_counter()
            manager.save_durable(step)
            call = time.perf_counter() - started
            forward_backward()  # the next step's forward and backward: the copy (and the write) run meanwhile
            waited = manager.wait_for_staging()
            optimizer.step()
            optimizer.zero_grad()
            # not closed here: a save still committing when the next one comes is waited for inside
            # that save_durable call, and counted (an untimed close() hid that wait)
            samples = [max_over_ranks(call), max_over_ranks(waited), max_over_ranks(call + waited)]
            if round:
                for values, sample in zip((call_s[writer], wait_s[writer], blocked_s[writer]), samples):
                    values.append(sample)
    for manager in lazy.values():
        manager.close()

    # 2. throughput, with each writer; the memory tier's cost in the loop broken down
    intervals = durable_intervals(args, model, optimizer, train_step, root) \
        if "throughput" in args.only and args.durable_every else []
    block = max([args.block, *(2 * n for n in intervals)])
    managers: dict[str, CheckpointManager | None] = {"none": None}
    for writer in args.writers:
        for every in intervals:
            durable_config = CheckpointConfig(save_interval=every, keep_last=2, writer=writer)
            managers[f"durable{every}-{writer}"] = CheckpointManager(root / f"durable{every}-{writer}", model,
                                                                     optimizer, config=durable_config)
    for writer in args.writers:
        memory_config = CheckpointConfig(save_interval=0, memory_interval=1, memory_dir=str(shm / writer / "node{node}"),
                                         writer=writer)
        run_dir = root / f"memory-{writer}"
        events = EventLog(run_dir / "events.jsonl", rank=rank, host="bench")
        memory_tier = build_memory_tier(run_dir, memory_config, mesh_shape=(args.ranks,), mesh_dim_names=("dp_shard",),
                                        ranks_per_node=args.ranks, model=model, events=events)
        managers[f"memory1-{writer}"] = CheckpointManager(run_dir, model, optimizer, config=memory_config,
                                                         memory=memory_tier, events=events)
    rates: dict[str, list[float]] = {mode: [] for mode in managers}
    reached: dict[str, list[float]] = {mode: [] for mode in managers}  # the memory tier's steps saved, per block
    in_save: dict[str, list[float]] = {mode: [] for mode in managers}
    in_wait: dict[str, list[float]] = {mode: [] for mode in managers}
    commit_wait: dict[str, list[float]] = {mode: [] for mode in managers}
    block_notes: list[str] = []  # per timed memory-tier block: what its slow steps may come from
    step = 0
    # each mode against no saves in ABBA quads (none X X none, then X none none X), so that the load of
    # a shared machine, which drifts over minutes, weighs on both sides of each ratio alike
    order: list[tuple[str, int]] = []
    for cycle in range(args.cycles if "throughput" in args.only else 0):
        for mode in [m for m in managers if m != "none"]:
            order += [(m, len(order) // 4) for m in abba_quad(cycle, "none", mode)]
    warmup = [(mode, -1) for mode in managers] if order else []  # one untimed block of each mode first
    quads: dict[int, dict[str, list[float]]] = {}
    for index, (mode, quad_id) in enumerate(warmup + order):
        timed = index >= len(warmup)
        manager = managers[mode]
        every = manager.config.save_interval if manager is not None else 0
        while every and (step + every - every // 2) % every:  # its durable saves inside the block, not at its ends
            step += 1
        settle(args)
        dist.barrier()
        started = time.perf_counter()
        saving = waiting = 0.0
        memory = manager.memory if manager is not None else None
        skipped_before = skipped_of(memory)
        locks_before = getattr(MAPPED, "page_locks", 0)
        save_ms: list[float] = []
        collections = FullCollections()
        collections.__enter__()
        for _ in range(block):
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
                save_ms.append(1000 * (time.perf_counter() - begun))
        settle(args)
        elapsed = max_over_ranks(time.perf_counter() - started)
        collections.__exit__()
        # a run goes on past a block: its saves still writing are awaited after the timer, and reported
        begun = time.perf_counter()
        if manager is not None:
            manager.close()
        waited_after = max_over_ranks(time.perf_counter() - begun)
        if timed:
            rates[mode].append(block / elapsed)
            quads.setdefault(quad_id, {}).setdefault(mode, []).append(block / elapsed)
            in_save[mode].append(max_over_ranks(saving) / block)
            in_wait[mode].append(max_over_ranks(waiting) / block)
            commit_wait[mode].append(waited_after)
            if memory is not None:
                reached[mode].append(1 - (skipped_of(memory) - skipped_before) / block)
                block_notes.append(f"{mode} block {len(reached[mode])}: {block / elapsed:.3f} steps/s; save() max "
                                   f"{max(save_ms):.1f} ms, {sum(ms > 20 for ms in save_ms)} over 20 ms; full "
                                   f"collections {collections.count} ({1000 * collections.seconds:.0f} ms); mappings "
                                   f"page-locked {getattr(MAPPED, 'page_locks', 0) - locks_before}")
    profile = cpu_profile(args, model, optimizer, train_step, root, shm) if "profile" in args.only else []
    if "trace" in args.only:
        trace(args, model, optimizer, forward_backward, root, shm)
    shutil.rmtree(shm, ignore_errors=True)

    if rank == 0:
        where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        print(f"\nstate: {args.preset}, {total_bytes / 1e9:.3f} GB (model + AdamW) over {args.ranks} ranks on {where} "
              f"({args.threads} torch threads each); "
              f"seq {args.seq_len} x batch {args.batch} per rank ({args.ranks * args.seq_len * args.batch} tokens per step); "
              f"load average at the end {os.getloadavg()[0]:.2f}\n")
        if profile:
            print(f"| CPU time, per rank ({' / '.join(f'rank {r}' for r in range(args.ranks))}) | ms |\n|---|---:|")
            for label, values in profile:
                print(f"| {label} | {' / '.join(f'{v:.1f}' for v in values)} |")
            print()
        print("| figure | median | samples |\n|---|---:|---|")
        if blocked:
            print(f"| sync save, until committed (s) | {median(sync_s):.3f} | {', '.join(f'{x:.3f}' for x in sync_s)} |")
            for writer in args.writers:
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
                    print(f"| {mode}: the wait after a block for its saves to commit (ms, untimed) | "
                          f"{1000 * median(commit_wait[mode]):.1f} | |")
            print("\nmemory tier, per step (ms, rank 0): " + "; ".join(
                f"{writer}: {memory_profile(root / f'memory-{writer}')}" for writer in args.writers))
            print("memory tier, share of the timed steps saved (the others skipped: the previous write still "
                  "running): " + "; ".join(f"{writer}: {statistics.mean(reached[f'memory1-{writer}']):.3f}"
                                          for writer in args.writers))
            print("\n".join(f"rank {rank}, {note}" for note in block_notes))
            print("memory tier, copies planned into its files (0: staged in buffers, then serialised): " + "; ".join(
                f"{writer}: {managers[f'memory1-{writer}'].memory.in_place.plans}" for writer in args.writers))
        print()
        if blocked:
            for writer in args.writers:
                value = median(blocked_s[writer])
                print_result(f"blocked time per async save vs sync save (s), writer {writer}", value, median(sync_s),
                             f"ratio <= {TARGET_BLOCKED}", value <= TARGET_BLOCKED * median(sync_s), **device_fields(args))
        if "throughput" in args.only:
            for writer in args.writers:
                for mode, target, label in ([(f"durable{n}-{writer}", TARGET_DURABLE, f"durable async save every {n} steps")
                                             for n in intervals]
                                            + [(f"memory1-{writer}", TARGET_MEMORY, "memory tier every step")]):
                    ratios = [statistics.mean(q[mode]) / statistics.mean(q["none"]) for q in quads.values() if mode in q]
                    value = median(ratios)
                    print(f"{mode}: ratios of its ABBA quads {', '.join(f'{r:.3f}' for r in ratios)}")
                    share = {"steps_saved_share": statistics.mean(reached[mode])} if reached[mode] else {}
                    print_result(f"steps/s with a {label} vs no saves, writer {writer} (median of ABBA quad ratios)",
                                 value * median(rates["none"]), median(rates["none"]), f"ratio >= {target}",
                                 value >= target, **share, **device_fields(args))
                    # interference only slows a block: the fastest block of each mode is the figure the
                    # noise of a shared or virtual machine moves least
                    fastest, fastest_none = max(rates[mode]), max(rates["none"])
                    print_result(f"steps/s with a {label} vs no saves, writer {writer} (fastest block of each)",
                                 fastest, fastest_none, f"ratio >= {target}", fastest >= target * fastest_none,
                                 **device_fields(args))
    dist.barrier()
    dist.destroy_process_group()


def cpu_profile(args, model, optimizer, train_step, root: Path, shm: Path) -> list[tuple[str, list[float]]]:
    """Figure 4 (see the module's doc): ``(label, [ms of rank 0, ms of rank 1])`` rows."""
    import torch
    import torch.distributed as dist
    import xxhash

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.hashing_file import write_records
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.events import EventLog
    from trainguard.step.local_tier import build_memory_tier

    rank = dist.get_rank()
    rows: list[tuple[str, float]] = []
    saves, steps = (2, 6) if args.quick else (3, 6)

    def measure(label: str, save, finish, files, count: int) -> None:
        """CPU of ``count`` saves, the training thread idle: this process's, and its writer process's;
        and the full garbage collections the saves set off in this process (each scans every object
        of the process, holding the GIL)."""
        save(), finish()  # warm: allocation, plans, spares, the writer process's start
        own = theirs = 0.0
        full_collections = FullCollections()
        for _ in range(count):
            train_step()
            settle(args)
            dist.barrier()
            pid = getattr(files, "pid", None)
            started, started_writer = time.process_time(), process_cpu(pid)
            with full_collections:
                save()
                finish()
            own += time.process_time() - started
            theirs += process_cpu(pid) - started_writer
        rows.append((f"{label}: full garbage collections per save (count)", full_collections.count / count))
        rows.append((f"{label}: full garbage collections per save (ms)", 1000 * full_collections.seconds / count))
        rows.append((f"{label}: training process", 1000 * own / count))
        if getattr(files, "pid", None) is not None:
            rows.append((f"{label}: writer process", 1000 * theirs / count))
            rows.append((f"{label}: both", 1000 * (own + theirs) / count))

    step = 10_000
    for writer in args.writers:
        manager = CheckpointManager(root / f"profile-{writer}", model, optimizer, keep_last=1,
                                    config=CheckpointConfig(save_interval=0, writer=writer))

        def save_durable(manager: CheckpointManager = manager) -> None:
            nonlocal step
            step += 1
            manager.save_durable(step)

        measure(f"durable async save, writer {writer}", save_durable, manager.close, manager.durable.files, saves)
        capture = manager.durable.capture.take(model, optimizer)
        manager.close()
    for writer in args.writers:
        config = CheckpointConfig(save_interval=0, memory_interval=1, memory_dir=str(shm / f"profile-{writer}" / "node{node}"),
                                  writer=writer)
        run_dir = root / f"profile-memory-{writer}"
        events = EventLog(run_dir / "events.jsonl", rank=rank, host="bench")
        memory = build_memory_tier(run_dir, config, mesh_shape=(args.ranks,), mesh_dim_names=("dp_shard",),
                                   ranks_per_node=args.ranks, model=model, events=events)
        manager = CheckpointManager(run_dir, model, optimizer, config=config, memory=memory, events=events)

        def save_memory(manager: CheckpointManager = manager) -> None:
            nonlocal step
            step += 1
            manager.save_memory(step)

        for _ in range(3):  # the pruned steps' spares exist from here on
            save_memory(), manager.memory.wait()
        measure(f"memory tier step, writer {writer}", save_memory, manager.memory.wait, manager.memory.files, steps)
        manager.close()

    # the pieces, on this rank's staged bytes (the durable tier's staging buffers, just filled)
    buffers = [buffer for buffer, _ in capture.plan.copies]
    sources = [source.detach() for _, source in capture.plan.copies]
    views = [buffer.view(-1).view(torch.uint8).numpy() for buffer in buffers if buffer.numel()]
    nbytes = sum(view.nbytes for view in views)

    def thread_cpu(action) -> float:
        started = time.thread_time()
        action()
        return 1000 * (time.thread_time() - started)

    def copy() -> None:
        for buffer, source in zip(buffers, sources):
            buffer.copy_(source)

    def digest() -> None:
        hasher = xxhash.xxh3_64()
        for view in views:
            hasher.update(view)

    scratch = shm / f"pieces-{rank}"
    scratch.mkdir(parents=True, exist_ok=True)

    def write_to(path: Path, flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | flags, 0o644)
        try:
            for view in views:
                memory_view = memoryview(view)
                while memory_view:
                    memory_view = memory_view[os.write(fd, memory_view):]
        finally:
            os.close(fd)

    disk = root / f"pieces-{rank}.bin"
    rows.append(("staged bytes of this rank (MB)", nbytes / 1e6))
    rows.append(("piece: memcpy into staging (torch copy_)", thread_cpu(copy)))
    rows.append(("piece: xxh3_64 of the staged bytes", thread_cpu(digest)))
    rows.append((f"piece: os.write into a new file in {root.parent} (page cache)", thread_cpu(lambda: write_to(disk, os.O_CREAT))))
    fd = os.open(disk, os.O_WRONLY)
    started = time.perf_counter()
    os.fsync(fd)
    os.close(fd)
    rows.append(("piece: its fsync (wall)", 1000 * (time.perf_counter() - started)))
    disk.unlink()
    write_to(scratch / "over", os.O_CREAT)
    rows.append(("piece: os.write over an existing file in /dev/shm", thread_cpu(lambda: write_to(scratch / "over", 0))))
    started = time.process_time()
    write_records(root / f"pieces-{rank}.distcp", buffers)
    rows.append((f"piece: write_records of the staged tensors in {root.parent} (serialise, hash, write, fsync)",
                 1000 * (time.process_time() - started)))
    (root / f"pieces-{rank}.distcp").unlink()
    shutil.rmtree(scratch, ignore_errors=True)
    settle(args)
    dist.barrier()
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(3):
        train_step()
    settle(args)
    step_cpu = 1000 * (time.process_time() - started_cpu) / 3
    step_ms = 1000 * max_over_ranks((time.perf_counter() - started) / 3)
    rows.append(("a training step without saves (wall, max over ranks)", step_ms))
    rows.append(("a training step without saves (CPU of this rank)", step_cpu))
    rows.append((f"CPU a durable save every {DURABLE_INTERVAL} steps may take for >= {TARGET_DURABLE}",
                 (1 - TARGET_DURABLE) * DURABLE_INTERVAL * step_cpu))
    rows.append((f"CPU a memory-tier step may take for >= {TARGET_MEMORY}", (1 - TARGET_MEMORY) * step_cpu))
    # a rank that has its core to itself and no spare one: the saves' CPU adds to its steps' CPU
    measured = dict(rows)
    for writer in args.writers:
        for label, interval, kind in ((f"durable async save, writer {writer}", DURABLE_INTERVAL, "durable every 10"),
                                      (f"memory tier step, writer {writer}", 1, "memory tier every step")):
            save_cpu = measured.get(f"{label}: both", measured[f"{label}: training process"])
            rows.append((f"expected steps/s ratio, {kind}, writer {writer}, one busy core per rank (x1000)",
                         1000 * step_cpu / (step_cpu + save_cpu / interval)))
    gathered: list = [None] * args.ranks
    dist.all_gather_object(gathered, rows)
    return [(label, [part[index][1] for part in gathered]) for index, (label, _) in enumerate(rows)]


def trace(args, model, optimizer, forward_backward, root: Path, shm: Path) -> None:
    """Figure 5 (see the module's doc), printed by every rank for itself."""
    import cProfile
    import io
    import pstats
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist
    import xxhash

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.checkpoint.writer_process import IN_PROCESS
    from trainguard.events import EventLog
    from trainguard.step.local_tier import build_memory_tier

    rank = dist.get_rank()
    out = Path(args.trace_dir) if args.trace_dir else root / "trace"
    out.mkdir(parents=True, exist_ok=True)

    class ProfiledWriter:
        """``checkpoint.writer: thread``'s writer, with cProfile on while it writes."""

        def __init__(self) -> None:
            self.profile = cProfile.Profile()

        def start(self) -> None:
            """Nothing to start: it writes in the calling thread."""

        def received(self, value):
            return IN_PROCESS.received(value)

        def run(self, function, *run_args, **kwargs):
            self.profile.enable()
            try:
                return function(*run_args, **kwargs)
            finally:
                self.profile.disable()

    def top(profile: cProfile.Profile, label: str) -> None:
        profile.dump_stats(str(out / f"{label}-rank{rank}.prof"))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(f"\n[rank {rank}] {label}: the writing thread's CPU profile (cProfile, top by own time)\n"
              + "\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step = 20_000
    timings: dict[str, list[list[float]]] = {}

    def timed_steps(label: str, manager: CheckpointManager, count: int) -> None:
        nonlocal step
        rows = timings.setdefault(label, [])
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(count):
                step += 1
                marks = [time.perf_counter()]
                forward_backward()
                settle(args)
                marks.append(time.perf_counter())
                manager.wait_for_staging()
                marks.append(time.perf_counter())
                optimizer.step()
                optimizer.zero_grad()
                settle(args)
                marks.append(time.perf_counter())
                manager.save(step)
                marks.append(time.perf_counter())
                rows.append([1000 * (b - a) for a, b in zip(marks, marks[1:])])
            manager.close()
        profiler.export_chrome_trace(str(out / f"{label}-rank{rank}.json.gz"))
        print(f"\n[rank {rank}] {label}: per step (ms): forward+backward | wait for the copy | optimizer step | save()",
              flush=True)
        for row in rows:
            print("  " + " | ".join(f"{value:8.2f}" for value in row))
        table = profiler.key_averages().table(sort_by="self_cuda_time_total" if args.device == "cuda"
                                              else "self_cpu_time_total", row_limit=12)
        print(table, flush=True)

    config = CheckpointConfig(save_interval=0, memory_interval=1, memory_dir=str(shm / "trace" / "node{node}"),
                              writer="thread")
    run_dir = root / "trace-memory"
    events = EventLog(run_dir / "events.jsonl", rank=rank, host="bench")
    memory = build_memory_tier(run_dir, config, mesh_shape=(args.ranks,), mesh_dim_names=("dp_shard",),
                               ranks_per_node=args.ranks, model=model, events=events)
    manager = CheckpointManager(run_dir, model, optimizer, config=config, memory=memory, events=events)
    for _ in range(3):  # plans, spares, page-locked mappings
        step += 1
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step)
    manager.memory.wait()
    writer = ProfiledWriter()
    manager.memory.files = writer
    timed_steps("memory-every-step", manager, 6)
    top(writer.profile, "memory-every-step")
    print(f"[rank {rank}] memory tier: {memory_profile(run_dir)}", flush=True)

    durable = CheckpointManager(root / "trace-durable", model, optimizer, keep_last=1,
                                config=CheckpointConfig(save_interval=DURABLE_INTERVAL, writer="thread"))
    step = 20_000 + 10 * ((step - 20_000) // 10 + 1) - 3  # a durable save falls inside the traced steps
    durable.save_durable(step), durable.close()  # warm: buffers, plans
    writer = ProfiledWriter()
    durable.durable.files = writer
    timed_steps("durable-every-10", durable, 6)
    top(writer.profile, "durable-every-10")

    # the pieces, on this rank's own state
    sources = [t.detach() for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values()
                                                           if isinstance(v, torch.Tensor))]]
    sources = [s.to_local() if hasattr(s, "to_local") else s for s in sources]
    pinned = [torch.empty(s.shape, dtype=s.dtype, pin_memory=args.device == "cuda") for s in sources]
    nbytes = sum(s.nbytes for s in sources)
    for _ in range(2):
        settle(args)
        started = time.perf_counter()
        for buffer, source in zip(pinned, sources):
            buffer.copy_(source, non_blocking=True)
        settle(args)
        copy_s = time.perf_counter() - started
    views = [memoryview(b.view(-1).view(torch.uint8).numpy()) for b in pinned if b.numel()]
    whole = bytearray(nbytes)
    position = 0
    for view in views:
        whole[position:position + view.nbytes] = view
        position += view.nbytes
    piece = 64 << 20
    pieces = [memoryview(whole)[start:start + piece] for start in range(0, nbytes, piece)]
    started = time.perf_counter()
    xxhash.xxh3_64(whole).intdigest()
    one_s = time.perf_counter() - started
    results = {}
    for threads in (2, 4, 8):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: xxhash.xxh3_64(p).intdigest(), pieces))  # warm the threads
            started = time.perf_counter()
            list(pool.map(lambda p: xxhash.xxh3_64(p).intdigest(), pieces))
            results[threads] = time.perf_counter() - started
    print(f"\n[rank {rank}] pieces on {nbytes / 1e9:.3f} GB: device-to-host copy into page-locked memory "
          f"{1000 * copy_s:.1f} ms ({nbytes / copy_s / 1e9:.1f} GB/s); xxh3_64 one thread {1000 * one_s:.1f} ms "
          f"({nbytes / one_s / 1e9:.1f} GB/s); in 64 MiB pieces: "
          + ", ".join(f"{n} threads {1000 * s:.1f} ms" for n, s in results.items()), flush=True)
    dist.barrier()


class FullCollections:
    """Counts and times the garbage collector's full (generation 2) collections while entered."""

    def __init__(self) -> None:
        self.count, self.seconds, self._started = 0, 0.0, 0.0

    def _observe(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._observe)


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system, every thread, ended ones included) of process ``pid``; 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
                      "--saves", str(args.saves), "--cycles", str(args.cycles), "--block", str(args.block), "--only", *args.only,
                      "--durable-every", *args.durable_every, "--mtbf-hours", str(args.mtbf_hours),
                      "--writers", *args.writers, "--ranks", str(args.ranks), "--device", args.device,
                      "--threads", str(args.threads), "--inner",
                      *(["--trace-dir", os.path.abspath(args.trace_dir)] if args.trace_dir else []),
                      "--dir", str(work)]
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
                               os.path.abspath(__file__), *inner_args], env=env).returncode
        if code != 0:
            sys.exit(code)
        if "kill" in args.only and args.device == "cpu":
            steps_redone(args, work)
        elif "kill" in args.only:
            print("kill: measured on the CPU only (`trainguard train` kills rank 1 of 2, one GPU holds one NCCL rank)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
