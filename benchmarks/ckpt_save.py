"""Benchmark: checkpoint save paths side by side, on the same >= 1 GiB FSDP2 state, in one run.

How it runs: under ``torchrun`` with one process per rank (2 by default), gloo on CPU::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/ckpt_save.py --gib 1 [--repeats 3] [--dir /tmp] [--json results.json]

Started without torchrun (``python benchmarks/ckpt_save.py --gib 1``) it re-executes itself under
``torch.distributed.run --standalone --nproc-per-node N`` (``--ranks``, default 2), with
``OMP_NUM_THREADS=1`` unless set.

The state: ``nn.Sequential`` of plain ``nn.Linear(width, width)`` layers, each and the root sharded
with FSDP2 ``fully_shard`` on a 1-D gloo mesh, plus AdamW whose state one real forward/backward/step
has initialized. Layers are added until model + optimizer state is >= ``--gib`` GiB across ranks.
"State bytes" are the bytes of every rank's local tensors in ``get_state_dict(model, optimizer)``.

What is timed (wall time, the maximum over ranks, all ranks writing at once):

1. ``raw``        every rank writes its local state's bytes sequentially to one file, fsync (file and
                  directory): what the disk can do.
2. ``torch.save`` every rank ``torch.save``s its local state dict (DTensors as local tensors), fsync.
3. ``dcp``        ``get_state_dict`` + synchronous ``torch.distributed.checkpoint.save`` (fsyncs files).
4. ``tg sync``    ``CheckpointManager(..., async_save=False).save_durable(step)`` then ``.close()``: until the
                  checkpoint is committed (manifest with checksums written, directory renamed).
5. ``tg async``   ``CheckpointManager(..., async_save=True)``: the time ``save_durable()`` plus
                  ``wait_for_staging()`` block the caller (here nothing runs between them, so the whole
                  copy blocks; ``benchmarks/nostall.py`` measures it overlapped with a forward and
                  backward), and the time until ``close()`` returns (committed). One manager is kept for the whole
                  run, as a training loop keeps it, so this is a save after the first: its staging
                  buffers already exist (the warm-up round made the first save).
6. ``tg async first`` the same with a new manager each time: the first save of a run, which also
                  allocates the staging buffers (their pages are first touched by the copy).

Each measurement writes a fresh directory under ``--dir`` that is deleted right after. One warm-up
round is not counted; then ``--repeats`` rounds run every method, the order rotated each round, and
the table shows medians. Trainguard's internal phases are timed by wrapping the functions that
``trainguard.checkpoint.durable`` calls, its stager and writer, and ``os.fsync`` (in this process
only; trainguard itself is unchanged); the breakdown tables show their medians per rank.

It is a benchmark: targets are reported as met or missed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

TARGET_SYNC_VS_RAW = 0.9  # trainguard sync throughput / raw write throughput, at least
TARGET_ASYNC_BLOCK = 0.05  # trainguard async save() blocking time / trainguard sync time, at most

METHODS = ["raw", "torch_save", "dcp", "tg_sync", "tg_async", "tg_async_first"]

from common import median, print_result, relaunch_under_torchrun


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="model + optimizer state across ranks, GiB (default 1)")
    p.add_argument("--width", type=int, default=2048, help="nn.Linear width (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, each method once per round (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--dir", default=None, help="where to write (a temporary directory is made inside; default /tmp)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--ranks", type=int, default=2, help="ranks when not started by torchrun (default 2)")
    p.add_argument("--quick", action="store_true", help="a small variant: --gib 0.25 --repeats 2")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeats = 0.25, 2
    if args.repeats < 1 or args.warmup < 0 or args.gib <= 0 or args.width < 1:
        p.error("--repeats >= 1, --warmup >= 0, --gib > 0 and --width >= 1 are required")
    return args


# --------------------------------------------------------------------------------------------- phases
class PhaseRecorder:
    """Accumulates seconds per phase name; phases nest per thread (``outer>inner``)."""

    def __init__(self) -> None:
        self.active = False
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def reset(self) -> None:
        with self._lock:
            self.seconds = {}

    def add(self, name: str, seconds: float) -> None:
        if not self.active:
            return
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def _stack(self) -> list[str]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def qualified(self, name: str) -> str:
        stack = self._stack()
        return ">".join([*stack, name]) if stack else name

    @contextmanager
    def phase(self, name: str):
        full = self.qualified(name)
        stack = self._stack()
        stack.append(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            stack.pop()
            self.add(full, time.perf_counter() - started)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper


PHASES = PhaseRecorder()


def instrument_trainguard() -> None:
    """Wraps what ``trainguard.checkpoint.durable`` calls, in this process only, to time each phase."""
    import types

    import torch.distributed.checkpoint as dcp

    import trainguard.checkpoint.commit as commit
    import trainguard.checkpoint.dcp_writer as dcp_writer
    import trainguard.checkpoint.durable as durable
    import trainguard.checkpoint.hashing_file as hashing_file
    import trainguard.checkpoint.snapshot as snapshot
    import trainguard.checkpoint.state_dict as state_dict

    state_dict.get_state_dict = PHASES.wrap("get_state_dict", state_dict.get_state_dict)
    durable.build_manifest = PHASES.wrap("build_manifest", durable.build_manifest)
    for name in ("fsync_file", "fsync_tree", "write_manifest", "commit_directory", "write_latest"):
        setattr(commit, name, PHASES.wrap(name, getattr(commit, name)))
    dcp_writer.dcp = types.SimpleNamespace(save=PHASES.wrap("dcp.save", dcp.save), load=dcp.load)
    cls = durable.DurableCheckpointer
    cls._apply_retention = PHASES.wrap("retention", cls._apply_retention)
    durable.write_rank_files = PHASES.wrap("write files (extra state, dcp.save)", durable.write_rank_files)
    durable.gather_entries = PHASES.wrap("gather checksums to rank 0", durable.gather_entries)
    writer = dcp_writer.ChecksummingFileSystemWriter
    writer.write_data = PHASES.wrap("write_data (serialize, hash, write, fsync)", writer.write_data)
    stream = hashing_file.HashingFile
    stream.close_durably = PHASES.wrap("close_durably (fsync)", stream.close_durably)
    snapshot.LazySnapshot.wait = PHASES.wrap("wait for staging (the copy left; blocks the caller)",
                                             snapshot.LazySnapshot.wait)
    # Every fsync, attributed to the phase it happens in (e.g. "dcp.save>os.fsync").
    real_fsync = os.fsync

    def fsync(fd):
        with PHASES.phase("os.fsync" if PHASES._stack() else "os.fsync outside any phase"):
            return real_fsync(fd)

    os.fsync = fsync


# ------------------------------------------------------------------------------------------------ state
def build_state(args: argparse.Namespace, world: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_layer = 12 * (args.width * args.width + args.width)  # fp32 param + exp_avg + exp_avg_sq
    layers = max(1, math.ceil(args.gib * 2**30 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, args.width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, layers


def local_state(model, optimizer) -> dict[str, Any]:
    """``get_state_dict`` with every DTensor replaced by this rank's local shard."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, {"model": model_sd, "optim": optim_sd})


def local_tensors(state: dict[str, Any]) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------------------------------------- methods
class Clock:
    def __init__(self, dist) -> None:
        self.dist = dist
        self.t0 = 0.0
        self.marks: dict[str, float] = {}

    def start(self) -> None:
        self.dist.barrier()
        PHASES.reset()
        PHASES.active = True
        self.t0 = time.perf_counter()

    def mark(self, key: str) -> None:
        self.marks[key] = time.perf_counter() - self.t0


def write_all(fd: int, buffer) -> None:
    view = memoryview(buffer).cast("B")
    while view:
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


def run_raw(ctx, directory: Path, clock: Clock) -> None:
    buffers = [t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy() for t in ctx["tensors"]]
    path = directory / f"raw_rank{ctx['rank']}.bin"
    clock.start()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with PHASES.phase("write"):
            for buffer in buffers:
                write_all(fd, buffer)
        with PHASES.phase("fsync file"):
            os.fsync(fd)
    finally:
        os.close(fd)
    with PHASES.phase("fsync dir"):
        dir_fd = os.open(directory, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
    clock.mark("total")


def run_torch_save(ctx, directory: Path, clock: Clock) -> None:
    import torch

    path = directory / f"state_rank{ctx['rank']}.pt"
    clock.start()
    with PHASES.phase("get_state_dict (local)"):
        state = local_state(ctx["model"], ctx["optimizer"])
    with PHASES.phase("torch.save"):
        torch.save(state, path)
    with PHASES.phase("fsync file+dir"):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        fd = os.open(directory, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    clock.mark("total")


def run_dcp(ctx, directory: Path, clock: Clock) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    clock.start()
    with PHASES.phase("get_state_dict"):
        model_sd, optim_sd = get_state_dict(ctx["model"], ctx["optimizer"])
    with PHASES.phase("dcp.save"):
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(directory, sync_files=True))
    clock.mark("total")


def _manager(ctx, directory: Path, async_save: bool):
    from trainguard import CheckpointManager

    return CheckpointManager(directory, ctx["model"], ctx["optimizer"], async_save=async_save, keep_last=3)


def run_tg_sync(ctx, directory: Path, clock: Clock) -> None:
    manager = _manager(ctx, directory, async_save=False)
    clock.start()
    manager.save_durable(ctx["step"])
    manager.close()
    clock.mark("total")
    manager.events.close()


def run_tg_async(ctx, directory: Path, clock: Clock) -> None:
    """A later save of a long-lived manager: its staging buffers exist (the warm-up made them)."""
    manager = ctx.get("async_manager")
    if manager is None:
        manager = ctx["async_manager"] = _manager(ctx, ctx["base"] / "tg_async-manager", async_save=True)
    clock.start()
    manager.save_durable(ctx["step"])
    manager.wait_for_staging()  # no forward/backward here to overlap the copy with: all of it blocks
    clock.mark("blocked")
    manager.close()
    clock.mark("total")
    if ctx["rank"] == 0:  # hand the checkpoint to measure(), which counts its bytes and deletes it
        os.rename(manager.root / f"global_step_{ctx['step']}", directory / f"global_step_{ctx['step']}")


def run_tg_async_first(ctx, directory: Path, clock: Clock) -> None:
    """The first save of a new manager: it also allocates the staging buffers."""
    manager = _manager(ctx, directory, async_save=True)
    clock.start()
    manager.save_durable(ctx["step"])
    manager.wait_for_staging()  # no forward/backward here to overlap the copy with: all of it blocks
    clock.mark("blocked")
    manager.close()
    clock.mark("total")
    manager.events.close()


RUNNERS = {"raw": run_raw, "torch_save": run_torch_save, "dcp": run_dcp, "tg_sync": run_tg_sync,
           "tg_async": run_tg_async, "tg_async_first": run_tg_async_first}


def disk_bytes(directory: Path) -> int:
    return sum(os.path.getsize(Path(d, n)) for d, _, names in os.walk(directory) for n in names)


def measure(ctx, method: str, label: str) -> dict[str, Any]:
    """One timed save of ``method`` into a fresh directory, deleted afterwards; all ranks take part."""
    import torch
    import torch.distributed as dist

    directory = ctx["base"] / label
    if ctx["rank"] == 0:
        directory.mkdir()
    dist.barrier()
    clock = Clock(dist)
    ctx["step"] += 1
    RUNNERS[method](ctx, directory, clock)
    PHASES.active = False
    keys = sorted(clock.marks)
    local = torch.tensor([clock.marks[k] for k in keys], dtype=torch.float64)
    worst = local.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    phases: list[dict[str, float]] = [None] * ctx["world"]  # type: ignore[list-item]
    dist.all_gather_object(phases, dict(PHASES.seconds))
    size = 0
    if ctx["rank"] == 0:
        size = disk_bytes(directory)
        shutil.rmtree(directory)
    dist.barrier()
    return {"seconds": dict(zip(keys, worst.tolist())), "per_rank_phases": phases, "disk_bytes": size}


# ---------------------------------------------------------------------------------------------- report
def summarize(samples: dict[str, list[dict]], state_bytes: int, world: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for method, runs in samples.items():
        for key in sorted(runs[0]["seconds"]):
            values = [run["seconds"][key] for run in runs]
            name = method if key == "total" else f"{method}.{key}"
            rows[name] = {
                "samples_s": values,
                "median_s": median(values),
                "min_s": min(values),
                "max_s": max(values),
                "disk_bytes": median([run["disk_bytes"] for run in runs]),
            }
            rows[name]["gb_per_s"] = state_bytes / rows[name]["median_s"] / 1e9
        phase_names = sorted({p for run in runs for rank in run["per_rank_phases"] for p in rank})
        rows[method]["phases_median_s"] = {
            p: [median([run["per_rank_phases"][r].get(p, 0.0) for run in runs]) for r in range(world)]
            for p in phase_names
        }
    raw = rows["raw"]["median_s"]
    for row in rows.values():
        row["throughput_vs_raw"] = raw / row["median_s"]
    sync = rows["tg_sync"]["median_s"]
    # The same ratios per round (both measured in that round), whose median resists load drifting.
    paired_sync = [r["seconds"]["total"] / t["seconds"]["total"] for r, t in zip(samples["raw"], samples["tg_sync"])]
    paired_block = [a["seconds"]["blocked"] / t["seconds"]["total"]
                    for a, t in zip(samples["tg_async"], samples["tg_sync"])]
    ratios = {
        "tg_sync_throughput_vs_raw": {"value": raw / sync, "target": f">= {TARGET_SYNC_VS_RAW}",
                                      "met": raw / sync >= TARGET_SYNC_VS_RAW,
                                      "per_round": paired_sync, "per_round_median": median(paired_sync)},
        "tg_async_blocked_vs_tg_sync": {"value": rows["tg_async.blocked"]["median_s"] / sync,
                                        "target": f"<= {TARGET_ASYNC_BLOCK}",
                                        "met": rows["tg_async.blocked"]["median_s"] / sync <= TARGET_ASYNC_BLOCK,
                                        "per_round": paired_block, "per_round_median": median(paired_block)},
        "tg_async_committed_vs_tg_sync": {"value": rows["tg_async"]["median_s"] / sync},
        "tg_async_first_blocked_vs_tg_sync": {"value": rows["tg_async_first.blocked"]["median_s"] / sync},
        "tg_async_first_committed_vs_tg_sync": {"value": rows["tg_async_first"]["median_s"] / sync},
    }
    return {"rows": rows, "ratios": ratios}


LABELS = {
    "raw": "1 raw write + fsync",
    "torch_save": "2 torch.save + fsync",
    "dcp": "3 dcp.save (sync)",
    "tg_sync": "4 trainguard sync, to commit",
    "tg_async.blocked": "5 trainguard async, save() blocks",
    "tg_async": "5 trainguard async, to commit",
    "tg_async_first.blocked": "6 trainguard async 1st save, blocks",
    "tg_async_first": "6 trainguard async 1st save, to commit",
}


def print_report(summary: dict[str, Any], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    rows, ratios = summary["rows"], summary["ratios"]
    console.print(
        f"state {meta['state_bytes'] / 2**30:.3f} GiB ({meta['state_bytes'] / 1e9:.3f} GB) across {meta['world']} "
        f"ranks: {meta['layers']} x Linear({meta['width']}) + AdamW state; dir {meta['dir']} ({meta['fs']}); "
        f"torch {meta['torch']}; {meta['repeats']} timed rounds (+{meta['warmup']} warm-up); medians, wall time "
        f"= max over ranks; xxh3_64 from memory {meta['xxh3_from_memory_gb_per_s']:.2f} GB/s (1 thread)"
    )
    sync_met = "met" if ratios["tg_sync_throughput_vs_raw"]["met"] else "MISSED"
    block_met = "met" if ratios["tg_async_blocked_vs_tg_sync"]["met"] else "MISSED"
    table = Table(title="checkpoint save paths, same state")
    for col in ("path", "median s", "min-max s", "GB/s", "x raw GB/s", "on disk GB", "target"):
        table.add_column(col, justify="left" if col in ("path", "target") else "right")
    for name, label in LABELS.items():
        row = rows[name]
        target = ""
        if name == "tg_sync":
            target = f"x raw {ratios['tg_sync_throughput_vs_raw']['value']:.2f} >= {TARGET_SYNC_VS_RAW}: {sync_met}"
        elif name == "tg_async.blocked":
            target = (f"/ tg sync {ratios['tg_async_blocked_vs_tg_sync']['value']:.3f} <= {TARGET_ASYNC_BLOCK}: "
                      f"{block_met}")
        elif name == "tg_async":
            target = f"/ tg sync {ratios['tg_async_committed_vs_tg_sync']['value']:.2f}"
        elif name == "tg_async_first.blocked":
            target = f"/ tg sync {ratios['tg_async_first_blocked_vs_tg_sync']['value']:.3f}"
        elif name == "tg_async_first":
            target = f"/ tg sync {ratios['tg_async_first_committed_vs_tg_sync']['value']:.2f}"
        blocked = name.endswith(".blocked")
        throughput = "-" if blocked else f"{row['gb_per_s']:.3f}"
        vs_raw = "-" if blocked else f"{row['throughput_vs_raw']:.2f}"
        disk = "" if blocked else f"{row['disk_bytes'] / 1e9:.3f}"
        table.add_row(label, f"{row['median_s']:.3f}", f"{row['min_s']:.3f}-{row['max_s']:.3f}", throughput,
                      vs_raw, disk, target)
    console.print(table)
    console.print(
        "per-round ratios (same round), median: trainguard sync x raw "
        + ", ".join(f"{v:.2f}" for v in ratios["tg_sync_throughput_vs_raw"]["per_round"])
        + f" -> {ratios['tg_sync_throughput_vs_raw']['per_round_median']:.2f}; async blocks / sync "
        + ", ".join(f"{v:.3f}" for v in ratios["tg_async_blocked_vs_tg_sync"]["per_round"])
        + f" -> {ratios['tg_async_blocked_vs_tg_sync']['per_round_median']:.3f}"
    )

    world = meta["world"]
    for method in ("tg_sync", "tg_async", "tg_async_first", "dcp"):
        phases = rows[method]["phases_median_s"]
        breakdown = Table(title=f"where the time goes: {LABELS[method]} (median seconds per rank; "
                                f"nested phases are included in their parent)")
        breakdown.add_column("phase")
        for r in range(world):
            breakdown.add_column(f"rank {r}", justify="right")
        breakdown.add_row("(wall time, max over ranks)", *[f"{rows[method]['median_s']:.3f}"] * world)
        for name, per_rank in sorted(phases.items()):
            breakdown.add_row(name, *[f"{s:.3f}" for s in per_rank])
        console.print(breakdown)


def xxh3_rate(tensors) -> float:
    """xxh3_64 (trainguard's checksum) over this rank's tensors in memory, one thread: the CPU cost of
    hashing without any file read."""
    import torch
    import xxhash

    digest = xxhash.xxh3_64()
    total = 0
    started = time.perf_counter()
    for t in tensors:
        buffer = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(buffer)
        total += buffer.nbytes
    return total / (time.perf_counter() - started) / 1e9


def filesystem_of(path: Path) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1]
                if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                    best, kind = mount, f"{parts[2]} on {parts[0]}"
    except OSError:
        pass
    return kind


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(args.ranks, __file__)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    instrument_trainguard()

    model, optimizer, layers = build_state(args, world)
    state = local_state(model, optimizer)
    tensors = local_tensors(state)
    local_bytes = torch.tensor([sum(t.numel() * t.element_size() for t in tensors)], dtype=torch.int64)
    dist.all_reduce(local_bytes)
    state_bytes = int(local_bytes.item())

    made = [None]
    if rank == 0:
        parent = Path(args.dir or tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        made = [tempfile.mkdtemp(prefix="trainguard-bench-", dir=parent)]
    dist.broadcast_object_list(made, src=0)
    base = Path(made[0])
    ctx = {"rank": rank, "world": world, "model": model, "optimizer": optimizer, "tensors": tensors,
           "base": base, "step": 0}

    samples: dict[str, list[dict]] = {m: [] for m in METHODS}
    try:
        for round_index in range(args.warmup + args.repeats):
            timed = round_index >= args.warmup
            shift = round_index % len(METHODS)
            order = METHODS[shift:] + METHODS[:shift]
            for method in order:
                result = measure(ctx, method, f"r{round_index}-{method}")
                if timed:
                    samples[method].append(result)
                if rank == 0:
                    print(f"[{'round ' + str(round_index - args.warmup) if timed else 'warm-up'}] {method:10s} "
                          + " ".join(f"{k} {v:.3f}s" for k, v in sorted(result["seconds"].items())), flush=True)
    finally:
        if "async_manager" in ctx:
            ctx["async_manager"].close()
            ctx["async_manager"].events.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)

    if rank == 0:
        summary = summarize(samples, state_bytes, world)
        meta = {
            "state_bytes": state_bytes, "world": world, "layers": layers, "width": args.width,
            "dir": str(base.parent), "fs": filesystem_of(base.parent), "torch": torch.__version__,
            "repeats": args.repeats, "warmup": args.warmup, "python": platform.python_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
            "targets": {"tg_sync_throughput_vs_raw_min": TARGET_SYNC_VS_RAW,
                        "tg_async_blocked_vs_tg_sync_max": TARGET_ASYNC_BLOCK},
        }
        meta["xxh3_from_memory_gb_per_s"] = xxh3_rate(tensors)
        print_report(summary, meta)
        rows, ratios = summary["rows"], summary["ratios"]
        print_result("durable save throughput (GB/s), trainguard sync vs raw write+fsync",
                     rows["tg_sync"]["gb_per_s"], rows["raw"]["gb_per_s"],
                     ratios["tg_sync_throughput_vs_raw"]["target"], ratios["tg_sync_throughput_vs_raw"]["met"],
                     state_gib=state_bytes / 2**30)
        print_result("async save of a whole state staged at once: seconds the loop is blocked vs a sync save "
                     "(the trainer's lazy save is nostall.py's 'blocked time per async save' row)",
                     rows["tg_async.blocked"]["median_s"], rows["tg_sync"]["median_s"],
                     f"{ratios['tg_async_blocked_vs_tg_sync']['target']} (the lazy save's target, <= 0.01, "
                     "is judged by nostall.py)", ratios["tg_async_blocked_vs_tg_sync"]["met"],
                     state_gib=state_bytes / 2**30)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, **summary}, indent=2) + "\n")
            print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
