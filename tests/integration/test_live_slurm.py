"""A live run of a user's script under a real Slurm (issue 35): the ``slurm`` fixture's cluster (eight
slurmd logical nodes on this host), a batch job of 3 nodes whose script is ``trainguard run --launcher
slurm --nproc 4 --config tests/helpers/live_loop.yaml -- python tests/helpers/live_loop.py``. Each rank
is a job step of one task on its node (replica group 0 on the allocation's first node, group 1 on the
second, the third a spare node); the drill SIGKILLs rank 3 (its step's ``srun``), the others keep
stepping, the replacement, a new step on group 1's node, rejoins, and the end state is bitwise that of
the same command run without a fault, locally."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers.runs import trainguard
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path
from trainguard.live.samples import sample_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "helpers" / "live_loop.py"
STEPS, KILLED, KILL_AT = 30, 3, 10
SETS = [f"train.steps={STEPS}"]


def _run_args(run_dir: Path, *extra: str) -> list[str]:
    sets = [arg for item in (*SETS, *extra) for arg in ("--set", item)]
    return ["run", "--nproc", "4", "--config", str(EXAMPLE.with_suffix(".yaml")), "--run-dir", str(run_dir), *sets,
            "--", sys.executable, str(EXAMPLE)]


def slurm_node(pid: int) -> str | None:
    """The Slurm node a rank's process runs on, from its environment (slurmstepd sets it), None once gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [item.split(b"=", 1)[1].decode() for item in environ if item.startswith(b"SLURMD_NODENAME=")]
    return found[0] if found else None


def live_batch_job(slurm, tmp_path: Path, run_dir: Path, command: list[str]) -> tuple[str, dict[int, str | None]]:
    """``python -m trainguard COMMAND`` as the script of a batch job of 3 nodes, waited for; the job's output,
    and the Slurm node of each rank's process (by its ``live_start`` pid, read while it ran). The job must
    complete."""
    script = tmp_path / "live.sh"
    script.write_text(f"#!/bin/sh\n#SBATCH --nodes=3\n#SBATCH --job-name=live\n#SBATCH --time=10:00\n"
                      f"#SBATCH --output={tmp_path}/job.out\nexec {' '.join([sys.executable, '-m', 'trainguard', *command])}\n")
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=ROOT, capture_output=True, text=True,
                               env=slurm.env(OMP_NUM_THREADS="1"), timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    nodes: dict[int, str | None] = {}  # pid of a rank's process -> its Slurm node, read while it runs
    deadline = time.time() + 300
    while time.time() < deadline and slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
        if events_path(run_dir).exists():
            for event in read_events(events_path(run_dir)):
                if event["kind"] == "live_start" and event["pid"] not in nodes:
                    nodes[event["pid"]] = slurm_node(event["pid"])
        time.sleep(0.05)
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert slurm.job_state(job) == "COMPLETED", output[-4000:] + slurm.log_tail()
    return output, nodes


def test_a_live_run_under_slurm_replaces_a_killed_rank_on_its_node_and_ends_bitwise(slurm, tmp_path):
    run_dir = tmp_path / "slurm_run"
    launch = _run_args(run_dir, f"faults=kill:rank={KILLED},step={KILL_AT}")
    output, nodes = live_batch_job(slurm, tmp_path, run_dir, [launch[0], "--launcher", "slurm", *launch[1:]])
    assert f"live run finished: {STEPS} steps in " in output and f"ranks replaced: [{KILLED}]" in output, output[-4000:]
    allocation = output.split("on hosts ", 1)[1].split(", store at", 1)[0]
    events = list(read_events(events_path(run_dir)))
    starts = [e for e in events if e["kind"] == "live_start"]
    groups = allocation.split(", spare nodes ")[0].split(", ")
    # each rank a job step on its group's node; the killed rank's replacement on the same node (it lives)
    assert sorted((e["rank"], e["node"]) for e in starts) == sorted(
        [(0, groups[0]), (1, groups[0]), (2, groups[1]), (3, groups[1]), (KILLED, groups[1])]), (starts, allocation)
    # and Slurm agrees: slurmstepd's SLURMD_NODENAME in each process caught alive (the killed rank's first
    # process may end between two polls; every other one lives to the run's end)
    caught = {e["pid"]: nodes.get(e["pid"]) for e in starts}
    assert all(caught[e["pid"]] in (e["node"], None) for e in starts), (caught, starts)
    assert sum(node is not None for node in caught.values()) >= len(starts) - 1, (caught, starts)
    quorums = [e["members"] for e in events if e["kind"] == "live_quorum"]
    assert quorums == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]], quorums
    clean = trainguard(*_run_args(tmp_path / "clean"), timeout=240)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert run_differences(tmp_path / "clean", run_dir, 4) == {}
    assert replica_differences(run_dir, 4, 2) == {}
    assert sample_problems(events, STEPS, 8 * 8) == []
