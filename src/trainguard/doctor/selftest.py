"""``self_test``: the node self-test that runs before a node joins or rejoins a run.

One process per local rank (forked on CPU, spawned on CUDA, where forking is not allowed) burns in its
device and then joins a process group of the node's local ranks (gloo on CPU, nccl on CUDA, rendezvous
through a file) for the collective check; the storage check runs here, in each checkpoint directory.
A rank that crashes, or that does not finish within ``timeout`` (a hung collective), fails the test.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.doctor.burnin import burn_in
from trainguard.doctor.collective import check_collectives
from trainguard.doctor.defaults import DEFAULT_REPS, DEFAULT_STORAGE_MB
from trainguard.doctor.report import CheckResult, DoctorReport
from trainguard.doctor.storage import check_storage
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.faults import active_faults
from trainguard.faults.spec import FaultSpec, parse_faults


def default_nproc() -> int:
    """The node's local ranks: ``LOCAL_WORLD_SIZE`` under torchrun, else one per CUDA device, else 1."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def default_size() -> int:
    # large enough to load a GPU for a moment, small enough to stay short on a shared CPU
    return 4096 if torch.cuda.is_available() else 256


def _local_rank(rank: int, nproc: int, store: str, reps: int, size: int, faults: list[FaultSpec],
                out_dir: str, collective_timeout: float) -> None:
    """One local rank: burn-in of its device, then the collective check; results to ``out_dir``."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    target = f"rank {rank} ({torch.cuda.get_device_name(device) if cuda else 'cpu'})"
    results: list[CheckResult] = []
    try:
        if cuda:
            torch.cuda.set_device(device)
        mine = [spec for spec in faults if spec.rank is None or spec.rank == rank]
        results.append(burn_in(device, reps, size, faults=mine, target=target))
    except Exception as exc:
        results.append(CheckResult("burn-in", target, False, f"{type(exc).__name__}: {exc}"))
    try:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=nproc, timeout=timedelta(seconds=collective_timeout))
        results.append(check_collectives(rank, nproc, device))
    except Exception as exc:
        results.append(CheckResult("collective", f"rank {rank}", False, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    path = Path(out_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps([asdict(r) for r in results]))
    path.with_suffix(".tmp").rename(path)


def _run_local_ranks(nproc: int, reps: int, size: int, faults: list[FaultSpec], timeout: float) -> list[list[CheckResult]]:
    context = multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork")
    with tempfile.TemporaryDirectory(prefix="trainguard-doctor-") as tmp:
        store = os.path.join(tmp, "store")
        processes = [context.Process(target=_local_rank, daemon=True,
                                     args=(rank, nproc, store, reps, size, faults, tmp, max(1.0, timeout / 2)))
                     for rank in range(nproc)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        timed_out = [process.is_alive() for process in processes]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        per_rank = []
        for rank, process in enumerate(processes):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                per_rank.append([CheckResult(**r) for r in json.loads(path.read_text())])
                continue
            why = f"did not finish within {timeout:.0f}s (killed)" if timed_out[rank] else \
                f"died with exit code {process.exitcode}"
            per_rank.append([CheckResult("burn-in", f"rank {rank}", False, f"local rank {why}")])
        return per_rank


def _collective_summary(per_rank: list[list[CheckResult]], nproc: int) -> CheckResult:
    results = [r for results in per_rank for r in results if r.check == "collective"]
    failed = [r for r in results if not r.ok]
    missing = nproc - len(results)
    target = f"{nproc} local rank{'s' if nproc != 1 else ''}"
    seconds = max((r.seconds for r in results), default=0.0)
    if failed or missing:
        parts = [f"{r.target}: {r.detail}" for r in failed]
        if missing:
            parts.append(f"{missing} rank(s) never reached it")
        return CheckResult("collective", target, False, "; ".join(parts), seconds)
    return CheckResult("collective", target, True, results[0].detail if results else "no ranks", seconds)


def self_test(
    *,
    run_dir: str | os.PathLike | None = None,
    nproc: int | None = None,
    dirs: list[str | os.PathLike] | None = None,
    reps: int = DEFAULT_REPS,
    size: int | None = None,
    storage_mb: int = DEFAULT_STORAGE_MB,
    min_write_mb_s: float | None = None,
    faults: str | None = None,
    timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> DoctorReport:
    """Burn-in of every local device, collectives across ``nproc`` local ranks, storage of ``dirs``
    (default: ``RUN_DIR/checkpoints``, else the current directory).

    ``faults``: fault text (``miscompute`` entries are the doctor's); None means ``TRAINGUARD_FAULTS``.
    With ``run_dir`` the verdict is recorded as a ``doctor_passed`` or ``doctor_failed`` event (with the
    reason) in ``RUN_DIR/events.jsonl``.
    """
    nproc = default_nproc() if nproc is None else nproc
    size = default_size() if size is None else size
    for name, value, minimum in (("--nproc", nproc, 1), ("--reps", reps, 1), ("--size", size, 1),
                                 ("--storage-mb", storage_mb, 1)):
        if value < minimum:
            raise ConfigError(f"{name} must be ≥ {minimum}, got {value}")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: this node has only {torch.cuda.device_count()} CUDA devices")
    try:
        specs = active_faults(None)[1] if faults is None else parse_faults(faults)
    except ConfigError as exc:
        raise ConfigError(f"doctor faults: {exc}") from None
    miscompute = [spec for spec in specs if spec.kind == "miscompute"]
    if dirs is None:
        dirs = [Path(run_dir) / "checkpoints"] if run_dir is not None else [Path.cwd()]
    say = progress or (lambda message: None)
    started = time.perf_counter()

    say(f"burn-in and collectives on {nproc} local rank{'s' if nproc != 1 else ''}")
    per_rank = _run_local_ranks(nproc, reps, size, miscompute, timeout)
    checks = [r for results in per_rank for r in results if r.check == "burn-in"]
    checks.append(_collective_summary(per_rank, nproc))
    for directory in dirs:
        say(f"storage check of {directory}")
        checks.append(check_storage(directory, storage_mb, min_write_mb_s=min_write_mb_s))
    report = DoctorReport(socket.gethostname(), nproc, checks)

    if run_dir is not None:
        log = EventLog(Path(run_dir) / "events.jsonl", rank=None, host=report.host)
        seconds = time.perf_counter() - started
        if report.healthy:
            log.emit("doctor_passed", checks=len(checks), nproc=nproc, seconds=seconds)
        else:
            log.emit("doctor_failed", reason=report.reason, nproc=nproc, seconds=seconds,
                     failed=[{"check": c.check, "target": c.target, "detail": c.detail} for c in report.failures])
        log.close()
    return report
