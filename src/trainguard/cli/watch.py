"""``trainguard watch RUN_DIR``: the on-call watchdog of reference 002.

Every ``--interval`` seconds: is the run progressing (a rank's heartbeat newer than ``--stale-after``
seconds)? Under Slurm (``squeue`` on PATH), is a job named after the run running or scheduled? If
neither, it prints ``***ALERT: <run> is not RUNNING or SCHEDULED!***`` and runs ``--alert-cmd`` once
per incident (until the run progresses or is scheduled again). A held job (pending with reason
``JobHeld*``) and an ``squeue`` that fails (controller down) each have their own alert line. A run whose ranks all exited 0 has
finished: the watch says so and ends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.cli.arguments import seconds
from trainguard.errors import ConfigError
from trainguard.runtime.heartbeat import read_heartbeats


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("watch", help="alert when a run is neither progressing nor scheduled")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--interval", type=seconds, default=60.0, help="seconds between checks (default 60)")
    parser.add_argument("--stale-after", type=seconds, default=900.0,
                        help="seconds without a heartbeat that mean no progress (default 900)")
    parser.add_argument("--alert-cmd", help="shell command run once per incident (RUN and MESSAGE in its environment)")
    parser.add_argument("--job-name", help="Slurm job name to look for (default: the run directory's name)")
    parser.add_argument("--once", action="store_true", help="check once; exit 1 if it alerted")
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class SlurmState:
    """What ``squeue`` says of the job: its state and reason, or that squeue itself failed."""

    state: str = ""  # RUNNING, PENDING, ...; "" when no such job
    reason: str = ""  # squeue's %r: JobHeldAdmin, Priority, ...
    error: str | None = None  # squeue failed (controller down, bad configuration): its message

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and self.reason.startswith("JobHeld")


SCHEDULED = ("RUNNING", "PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED")


def slurm_state(job_name: str) -> SlurmState | None:
    """The user's job of that name as squeue shows it (a running one first); None without Slurm."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "--me", "--noheader", "--name", job_name, "--format", "%T %r"],
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return SlurmState(error="squeue did not answer within 60s")
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return SlurmState(error=lines[-1] if lines else f"squeue exited {out.returncode}")
    jobs = [tuple((line.split(None, 1) + [""])[:2]) for line in out.stdout.splitlines() if line.strip()]
    jobs.sort(key=lambda job: job[0] != "RUNNING")
    return SlurmState(*jobs[0]) if jobs else SlurmState()


def check(run_dir: Path, stale_after: float, job_name: str, now: float | None = None) -> tuple[str, str, str]:
    """('ok' | 'finished' | 'alert', the alert line (or ''), why)."""
    now = time.time() if now is None else now
    beats = read_heartbeats(run_dir)
    if beats and all(beat.phase == "exit" and beat.exit_code == 0 for beat in beats.values()):
        return "finished", "", "every rank exited 0"
    newest = max((beat.time for beat in beats.values()), default=None)
    if newest is not None and now - newest <= stale_after:
        return "ok", "", f"heartbeat {now - newest:.0f}s ago"
    age = "no heartbeat yet" if newest is None else f"last heartbeat {now - newest:.0f}s ago"
    slurm = slurm_state(job_name)
    if slurm is not None and slurm.error is not None:
        return "alert", f"***ALERT: {job_name}: squeue failed, cannot tell whether it is RUNNING or SCHEDULED!***", \
            f"{age}; squeue: {slurm.error}"
    if slurm is not None and slurm.held:
        return "alert", f"***ALERT: {job_name} is HELD ({slurm.reason}) and will not start until released!***", \
            f"{age}; scontrol release the job"
    if slurm is not None and slurm.state in SCHEDULED:
        return "ok", "", f"Slurm job {job_name} is {slurm.state}"
    return "alert", f"***ALERT: {job_name} is not RUNNING or SCHEDULED!***", \
        age + ("" if slurm is None else f", no Slurm job named {job_name} running or scheduled")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    name = args.job_name or run_dir.resolve().name
    in_incident = ""  # the alert of the incident under way: a new kind of alert is a new incident
    while True:
        verdict, message, why = check(run_dir, args.stale_after, name)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if verdict == "finished":
            print(f"{stamp} {name}: finished ({why})", flush=True)
            return 0
        if verdict == "alert":
            if in_incident != message:
                print(f"{stamp} {message} ({why})", flush=True)
                if args.alert_cmd:
                    env = {"RUN": str(run_dir), "MESSAGE": message}
                    result = subprocess.run(args.alert_cmd, shell=True, env={**os.environ, **env})
                    if result.returncode != 0:
                        print(f"{stamp} alert command exited {result.returncode}", file=sys.stderr, flush=True)
            in_incident = message
        else:
            if in_incident:
                print(f"{stamp} {name}: back to normal ({why})", flush=True)
            in_incident = ""
        if args.once:
            return 1 if verdict == "alert" else 0
        time.sleep(args.interval)
