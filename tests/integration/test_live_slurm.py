"""A live run of a user's script under a real Slurm (issue 35): the ``slurm`` fixture's cluster (eight
slurmd logical nodes on this host), a batch job of 3 nodes whose script is ``trainguard run --launcher
slurm --nproc 4 --config tests/helpers/live_loop.yaml -- python tests/helpers/live_loop.py``. Each rank
is a job step of one task on its node (replica group 0 on the allocation's first node, group 1 on the
second, the third a spare node); the drill SIGKILLs rank 3 (its step's ``srun``), the others keep
stepping, the replacement, a new step on group 1's node, rejoins, and the end state is bitwise that of
the same command run without a fault, locally (one clean run, shared). A second job (``--no-kill``) loses
group 1's node (set DOWN from outside): its ranks restart as job steps on the spare node, bitwise too."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

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


def live_batch_job(slurm, tmp_path: Path, run_dir: Path, command: list[str], options: tuple[str, ...] = (),
                   during: Callable[[], None] | None = None) -> tuple[str, dict[int, str | None]]:
    """``python -m trainguard COMMAND`` as the script of a batch job of 3 nodes (and the ``#SBATCH`` ``options``),
    waited for, ``during`` called at each look while it runs; the job's output, and the Slurm node of each
    rank's process (by its ``live_start`` pid, read while it ran). The job must complete."""
    script = tmp_path / "live.sh"
    script.write_text("#!/bin/sh\n#SBATCH --nodes=3\n#SBATCH --job-name=live\n#SBATCH --time=10:00\n"
                      + "".join(f"#SBATCH {option}\n" for option in options) +
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
        if during is not None:
            during()
        time.sleep(0.05)
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert slurm.job_state(job) == "COMPLETED", output[-4000:] + slurm.log_tail()
    return output, nodes


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    """The same command run locally without a fault, that both runs under Slurm end bitwise equal to."""
    run_dir = tmp_path_factory.mktemp("live_slurm_clean") / "clean"
    clean = trainguard(*_run_args(run_dir), timeout=240)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return run_dir


def test_a_live_run_under_slurm_replaces_a_killed_rank_on_its_node_and_ends_bitwise(slurm, tmp_path, clean_run):
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
    assert run_differences(clean_run, run_dir, 4) == {}
    assert replica_differences(run_dir, 4, 2) == {}
    assert sample_problems(events, STEPS, 8 * 8) == []


def test_a_live_run_under_slurm_replaces_a_lost_nodes_group_on_the_spare_node_and_ends_bitwise(slurm, tmp_path, clean_run):
    """Once the run committed a step, group 1's node is set DOWN (``scontrol update nodename=N state=down``:
    Slurm kills the job steps there and takes the node out of the job, which goes on: ``--no-kill``, without
    which Slurm ends the whole job when one of its nodes fails). The launcher sees both ranks' steps end,
    tries their node again (``srun`` refuses it), loses it (``node_command_failed``) and starts both as job
    steps on the spare node; group 0 trains on meanwhile; the end state is bitwise the fault-free run's."""
    run_dir, downed = tmp_path / "slurm_node_lost", []
    launch = _run_args(run_dir)

    def down_group_1s_node() -> None:
        if not downed and events_path(run_dir).exists() and any(
                e["kind"] == "live_samples" for e in read_events(events_path(run_dir))):
            allocation = (tmp_path / "job.out").read_text().split("on hosts ", 1)[1].split(", store at", 1)[0]
            downed.append(allocation.split(", spare nodes ")[0].split(", ")[1])
            slurm.run("scontrol", "update", f"nodename={downed[0]}", "state=down", "reason=live-node-lost-test")

    try:
        output, _ = live_batch_job(slurm, tmp_path, run_dir, [launch[0], "--launcher", "slurm", *launch[1:]],
                                   options=("--no-kill",), during=down_group_1s_node)
    finally:
        for node in downed:  # back for the session's other jobs
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    assert downed and f"live run finished: {STEPS} steps in " in output and "ranks replaced: [2, 3]" in output, \
        output[-4000:]
    spare = output.split(", spare nodes ", 1)[1].split(", store at", 1)[0]
    events = list(read_events(events_path(run_dir)))
    assert [(e["node"], e["reason"]) for e in events if e["kind"] == "live_node_lost"] == [(downed[0], "node_command_failed")]
    # each rank of group 1 tried on its node first (refused by Slurm), then started on the spare node
    assert {e["target"]: e["node"] for e in events if e["kind"] == "live_replacement"} == {2: spare, 3: spare}
    assert sorted(e["rank"] for e in events if e["kind"] == "live_start" and e["node"] == spare) == [2, 3]
    quorums = [e["members"] for e in events if e["kind"] == "live_quorum"]
    assert quorums[0] == [0, 1, 2, 3] and [0, 1] in quorums and quorums[-1] == [0, 1, 2, 3], quorums
    assert any(e["kind"] == "live_samples" and e["members"] == 2 for e in events), "no step while group 1 was out"
    assert run_differences(clean_run, run_dir, 4) == {}
    assert replica_differences(run_dir, 4, 2) == {}
    assert sample_problems(events, STEPS, 8 * 8) == []
