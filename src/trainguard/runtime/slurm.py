"""Slurm job scripts for long runs (reference 002): rendering (pure), and ending a job array's remaining tasks.

The script asks for the active nodes plus the spares, gets ``USR1`` some seconds before the time limit
(the ranks save and exit 16), runs as a job array whose elements run one at a time (``%1``) and each
resume the run, writes one log file per node (``%x-%j-%N.out``), keeps out the nodes the supervisor
excluded, and runs ``trainguard run --launcher slurm`` which starts one agent per node with ``srun``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_minutes(text: str) -> float:
    """Slurm's ``--time`` formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in minutes."""
    match = _TIME.match(text.strip())
    if not match:
        raise ValueError(f"not a Slurm time limit: {text!r} (e.g. 100:00:00 or 4-04:00:00)")
    days, a, b, c = match.groups()
    if days is not None:  # D-H[:M[:S]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if c is not None:  # H:M:S
        return int(a) * 60 + int(b) + int(c) / 60
    if b is not None:  # M:S
        return int(a) + int(b) / 60
    return float(int(a))  # M


@dataclass
class JobSpec:
    job_name: str
    run_dir: str
    train_args: list[str]
    python: str
    nodes: int = 1
    spare_nodes: int = 0
    nproc_per_node: int = 1
    time: str = "100:00:00"
    signal_seconds: int = 90
    array: int = 10
    exit_margin_mins: float = 10.0
    excluded: list[str] = field(default_factory=list)
    partition: str | None = None
    account: str | None = None
    extra_sbatch: list[str] = field(default_factory=list)
    supervisor_args: list[str] = field(default_factory=list)


def render_job_script(spec: JobSpec) -> str:
    exit_mins = time_limit_minutes(spec.time) - spec.exit_margin_mins
    if exit_mins <= 0:
        raise ValueError(f"--exit-margin-mins {spec.exit_margin_mins:g} leaves no time within --time {spec.time}")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes + spec.spare_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={spec.time}",
        f"#SBATCH --signal=USR1@{spec.signal_seconds}",
        f"#SBATCH --array=1-{spec.array}%1",
        "#SBATCH --output=%x-%j-%N.out",
        "#SBATCH --open-mode=append",
    ]
    if spec.excluded:
        lines.append(f"#SBATCH --exclude={','.join(spec.excluded)}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    lines += [f"#SBATCH {option}" for option in spec.extra_sbatch]
    train = ["train", "--nproc", str(spec.nproc_per_node), "--run-dir", spec.run_dir,
             "--set", f"lifecycle.exit_duration_in_mins={exit_mins:g}", *spec.train_args]
    run = ["run", "--launcher", "slurm", "--run-dir", spec.run_dir, "--nnodes", str(spec.nodes),
           "--spare-nodes", str(spec.spare_nodes), *spec.supervisor_args]
    lines += [
        "",
        "# Each element of the array resumes the run from its newest verified checkpoint; USR1 arrives",
        f"# {spec.signal_seconds}s before the limit and the ranks save and exit 16; the time limit is also",
        f"# checked in the trainer (lifecycle.exit_duration_in_mins={exit_mins:g}).",
        "set -euo pipefail",
        'echo "jobid ${SLURM_JOB_ID} array ${SLURM_ARRAY_JOB_ID:-}_${SLURM_ARRAY_TASK_ID:-} nodes ${SLURM_JOB_NODELIST}"',
        f"PYTHON={shlex.quote(spec.python)}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        "# exec: the supervisor is the batch step's process, so scancel -b and --signal=B:... reach it",
        'exec "$PYTHON" -m trainguard ' + shlex.join(run) + " -- \\",
        '    "$PYTHON" -m trainguard ' + shlex.join(train),
        "",
    ]
    return "\n".join(lines)


def cancel_pending_tasks(array_job: str) -> bool:
    """Cancels the tasks of a job array that have not started (the running one is left alone)."""
    if shutil.which("scancel") is None:
        return False
    return subprocess.run(["scancel", "--state=PENDING", array_job], capture_output=True).returncode == 0
