"""torchft on the live drill's workload, for ``live_recovery.py``: its lighthouse on loopback, one
``torchft_worker.py`` process per replica group, one group SIGKILLed once it has committed ``kill_at``
steps and started again at once (torchft's recovery: the scheduler restarts the replica group, which
heals from a live peer), and the figures read from the workers' step logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainguard.live.workload import Workload

WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
INSTALL_HINT = "not run: torchft not installed (pip install 'trainguard[torchft]' torch==2.13.0)"
RUN_TIMEOUT_S = 600.0


def torchft_available() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class TorchftRun:
    groups: int = 4  # replica groups of one rank each (torchft's DDP): the drill's 4 ranks
    steps: int = 60
    micro_batch_s: float = 0.02
    kill_group: int | None = None  # this group is SIGKILLed once it has committed kill_at steps
    kill_at: int = 0


def _log(run_dir: Path, group: int) -> Path:
    return run_dir / f"steps_{group}.jsonl"


def final_path(run_dir: Path, group: int) -> Path:
    return run_dir / f"final_{group}.pt"


def read_steps(run_dir: Path, groups: int) -> list[dict]:
    logs = [_log(run_dir, g) for g in range(groups)]
    return [json.loads(line) for log in logs if log.exists() for line in log.read_text().splitlines() if line.strip()]


def launch_torchft(run_dir: Path, run: TorchftRun) -> float | None:
    """Runs the job to its end; returns the kill's time (``time.time()``), or None without a kill."""
    from torchft.coordination import LighthouseServer

    run_dir.mkdir(parents=True)
    # the lighthouse settings of torchft's README (min 1 replica, 100 ms ticks, 10 s join timeout)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}

    ready = run_dir / "ready"
    ready.mkdir()

    def start(group: int, first: bool) -> subprocess.Popen:
        cmd = [sys.executable, str(WORKER), "--group", str(group), "--groups", str(run.groups), "--steps",
               str(run.steps), "--micro-batch-s", str(run.micro_batch_s), "--log", str(_log(run_dir, group)),
               "--final", str(final_path(run_dir, group)), *(["--ready-dir", str(ready)] if first else [])]
        with open(run_dir / f"worker_{group}.out", "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    procs = {g: start(g, first=True) for g in range(run.groups)}
    killed_at = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft run in {run_dir} did not end in {RUN_TIMEOUT_S:.0f} s")
            if run.kill_group is not None and killed_at is None:
                if any(s["group"] == run.kill_group and s["committed"] and s["step"] >= run.kill_at - 1
                       for s in read_steps(run_dir, run.groups)):
                    procs[run.kill_group].send_signal(signal.SIGKILL)
                    killed_at = time.time()
                    procs[run.kill_group].wait()
                    procs[run.kill_group] = start(run.kill_group, first=False)
            time.sleep(0.005)
        failed = {g: p.returncode for g, p in procs.items() if p.returncode != 0}
        if failed:
            raise RuntimeError(f"torchft workers failed {failed}: see {run_dir}/worker_*.out")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    return killed_at


def torchft_figures(run_dir: Path, run: TorchftRun, killed_at: float, clean_step_s: float) -> dict[str, float]:
    """Survivors' lost time: from the kill until every survivor has committed a step again, less the one
    fault-free step that commit would have taken anyway (the step in flight at the kill fails and the next
    one waits for the new quorum), plus what the replacement's heal added to a survivor's step beyond a
    fault-free step. Samples/s while degraded: the samples the survivors committed from the kill to the
    replacement's first commit, over that time."""
    steps = read_steps(run_dir, run.groups)
    survivors = [s for s in steps if s["group"] != run.kill_group and s["committed"] and s["end"] > killed_at]
    back = max(min(s["end"] for s in survivors if s["group"] == g) for g in range(run.groups) if g != run.kill_group)
    replacement = [s for s in steps if s["group"] == run.kill_group and s["start"] > killed_at and s["committed"]]
    rejoined = min(s["end"] for s in replacement)
    healing = [s["end"] - s["start"] for s in survivors if s["start"] <= rejoined <= s["end"]]  # its first step
    heal = max(0.0, max(healing, default=0.0) - clean_step_s)
    samples = sum(s["micro_batches"] for s in survivors if s["end"] <= rejoined) * Workload().micro_batch_size
    return {"lost": back - killed_at - clean_step_s + heal, "rejoin": rejoined - killed_at,
            "samples_s": samples / (rejoined - killed_at)}


def samples_per_s(run_dir: Path, groups: int) -> float:
    """A fault-free torchft run's committed samples per second, from its first step's end to its last's."""
    steps = [s for s in read_steps(run_dir, groups) if s["committed"]]
    first = min(s["end"] for s in steps)
    samples = sum(s["micro_batches"] for s in steps if s["end"] > first) * Workload().micro_batch_size
    return samples / (max(s["end"] for s in steps) - first)


def clean_step_s(run_dir: Path, groups: int) -> float:
    """A fault-free torchft run's median step time."""
    durations = sorted(s["end"] - s["start"] for s in read_steps(run_dir, groups) if s["committed"])
    return durations[len(durations) // 2]


def max_relative_difference(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """The largest ``||a - b|| / ||b||`` over the parameter tensors (0.0: bitwise equal)."""
    return max(float((other[name] - ref).norm() / ref.norm()) for name, ref in reference.items())


def final_parameters(run_dir: Path, group: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(final_path(run_dir, group), weights_only=True)
