"""A live run under a real Slurm that loses a node (issue 35, item 4): the ``slurm`` fixture's cluster, a
batch job of 3 nodes submitted with ``--no-kill`` (without it Slurm ends the whole job when one of its
nodes fails) whose script is ``trainguard run --launcher slurm --nproc 4 --config
tests/helpers/live_loop.yaml -- python tests/helpers/live_loop.py``: replica group 0 on the allocation's
first node, group 1 on the second, the third a spare node. Once the run has committed a step, the test
sets group 1's node DOWN (``scontrol update nodename=N state=down``: Slurm kills the job steps there and
takes the node out of the job). The launcher sees both ranks' steps end, tries the home node (``srun``
refuses it: ``Requested node configuration is not available``), loses it (``live_node_lost``, reason
``node_command_failed``) and starts both ranks as job steps on the spare node; group 0 trains on
meanwhile, and the end state is bitwise that of the same command run without a fault, locally."""

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
STEPS = 30


def _run_args(run_dir: Path) -> list[str]:
    return ["run", "--nproc", "4", "--config", str(EXAMPLE.with_suffix(".yaml")), "--run-dir", str(run_dir),
            "--set", f"train.steps={STEPS}", "--", sys.executable, str(EXAMPLE)]


def test_a_live_run_under_slurm_replaces_a_lost_nodes_group_on_the_spare_node_and_ends_bitwise(slurm, tmp_path):
    run_dir = tmp_path / "slurm_node_lost"
    launch = _run_args(run_dir)
    command = [sys.executable, "-m", "trainguard", launch[0], "--launcher", "slurm", *launch[1:]]
    output_file = tmp_path / "job.out"
    script = tmp_path / "live.sh"
    script.write_text(f"#!/bin/sh\n#SBATCH --nodes=3\n#SBATCH --no-kill\n#SBATCH --job-name=live-node-lost\n"
                      f"#SBATCH --time=10:00\n#SBATCH --output={output_file}\nexec {' '.join(command)}\n")
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=ROOT, capture_output=True, text=True,
                               env=slurm.env(OMP_NUM_THREADS="1"), timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    downed, deadline = None, time.time() + 300
    while time.time() < deadline and slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
        if downed is None and events_path(run_dir).exists() and any(
                e["kind"] == "live_samples" for e in read_events(events_path(run_dir))):
            text = output_file.read_text()
            downed = text.split("on hosts ", 1)[1].split(", store at", 1)[0].split(", spare nodes ")[0].split(", ")[1]
            slurm.run("scontrol", "update", f"nodename={downed}", "state=down", "reason=live-node-lost-test")
        time.sleep(0.05)
    output = output_file.read_text() if output_file.exists() else ""
    slurm.run("scontrol", "update", f"nodename={downed}", "state=resume", check=False)
    assert downed is not None and slurm.job_state(job) == "COMPLETED", output[-4000:] + slurm.log_tail()
    assert f"live run finished: {STEPS} steps in " in output and "ranks replaced: [2, 3]" in output, output[-4000:]
    hosts, spare = output.split("on hosts ", 1)[1].split(", store at", 1)[0].split(", spare nodes ")
    assert downed == hosts.split(", ")[1]
    events = list(read_events(events_path(run_dir)))
    assert [(e["node"], e["reason"]) for e in events if e["kind"] == "live_node_lost"] == [(downed, "node_command_failed")]
    # each rank of group 1 tried on its node first (refused by Slurm), then started on the spare node
    last_node = {e["target"]: e["node"] for e in events if e["kind"] == "live_replacement"}
    assert last_node == {2: spare, 3: spare}, last_node
    quorums = [e["members"] for e in events if e["kind"] == "live_quorum"]
    assert quorums[0] == [0, 1, 2, 3] and [0, 1] in quorums and quorums[-1] == [0, 1, 2, 3], quorums
    degraded = {e["step"] for e in events if e["kind"] == "live_samples" and e["members"] == 2}
    assert degraded, "group 0 committed no step while group 1 was out"
    clean = trainguard(*_run_args(tmp_path / "clean"), timeout=240)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert run_differences(tmp_path / "clean", run_dir, 4) == {}
    assert replica_differences(run_dir, 4, 2) == {}
    assert sample_problems(events, STEPS, 8 * 8) == []
