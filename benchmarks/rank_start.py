"""Rank start time by start method, and starts that hang: what the agent's fork server costs.

trainguard: the agent forks a fork server before its first thread and the ranks are forked from it
(``trainguard.runtime.fork_server``, what ``trainguard train`` does on CPU).
baseline: torch's ``start_method="fork"`` from the agent itself, after the rendezvous started its
threads (what ``trainguard train`` did before: rarely a rank hung in a futex in ``init_process_group``).
Also shown: Python's standard fork server (a new interpreter that imports the trainer once per
agent) and ``spawn`` (every rank imports it).

Each trial is a new agent process that imports the trainer (not timed, as the supervisor's fork of
an agent has it imported), then times from just before it starts its ranks (the fork server
included) until every rank has finished ``init_process_group`` and a barrier; a trial that has not
finished in ``--hang-after`` seconds counts as a hang and is killed with its ranks. Methods take
turns trial by trial, so load drift hits them alike.

Usage: python benchmarks/rank_start.py [--quick] [--trials N] [--nproc P]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, print_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("trainguard", "fork", "forkserver", "spawn")


def rank_main(out_dir: str) -> None:
    """A rank: joins the process group as the trainer does, then records when it got there."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    Path(out_dir, f"rank_{dist.get_rank()}").write_text(str(time.time()))
    dist.destroy_process_group()


def agent(method: str, nproc: int, out_dir: str) -> None:
    import multiprocessing
    import uuid

    import trainguard.trainer.loop  # noqa: F401  (the preload of launch_local)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainguard.runtime.fork_server import START_METHOD, run_rank, start_fork_server

    started = time.time()
    entrypoint, args = rank_main, (out_dir,)
    if method == "trainguard":
        start_fork_server()
        entrypoint, args = run_rank, (rank_main, out_dir)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["trainguard.trainer.loop"])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"is_host": True},
                          max_restarts=0, monitor_interval=0.1,
                          start_method=START_METHOD if method in ("trainguard", "forkserver") else method)
    elastic_launch(config, entrypoint=entrypoint)(*args)
    Path(out_dir, "started").write_text(str(started))


def trial(method: str, nproc: int, hang_after: float) -> float | None:
    """Seconds from the agent starting its ranks to all of them past init_process_group; None: a hang."""
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, __file__, "--agent", method, "--nproc", str(nproc), "--out", out_dir],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=hang_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        if proc.returncode != 0:
            raise SystemExit(f"{method}: the agent exited {proc.returncode}")
        started = float(Path(out_dir, "started").read_text())
        return max(float(p.read_text()) for p in Path(out_dir).glob("rank_*")) - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 trials per method")
    parser.add_argument("--trials", type=int, default=None, help="trials per method (default 10, quick 3)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hang-after", type=float, default=120.0)
    parser.add_argument("--agent", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent(args.agent, args.nproc, args.out)
        return
    trials = args.trials or (3 if args.quick else 10)
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    hangs = {m: 0 for m in args.methods}
    for number in range(trials):
        order = args.methods if number % 2 == 0 else list(reversed(args.methods))
        for method in order:
            seconds = trial(method, args.nproc, args.hang_after)
            if seconds is None:
                hangs[method] += 1
            else:
                times[method].append(seconds)
    print(f"{'method':<12}{'median s':>10}{'min s':>8}{'max s':>8}{'hangs':>7}   ({trials} trials, {args.nproc} ranks, "
          f"load {os.getloadavg()[0]:.1f})")
    for method in args.methods:
        values = times[method] or [float("nan")]
        print(f"{method:<12}{median(values):>10.2f}{min(values):>8.2f}{max(values):>8.2f}{hangs[method]:>7}")
    if "trainguard" in times and "fork" in times:
        ours, base = median(times["trainguard"]), median(times["fork"])
        print_result("rank start, fork server vs fork from the agent (s, median)", ours, base,
                     "under 1 s more than fork per start, no hang", ours - base < 1.0 and hangs["trainguard"] == 0,
                     trials=trials, hangs=json.dumps(hangs))


if __name__ == "__main__":
    main()
