"""Pure pieces of the lifecycle and the supervisor: policies, heartbeats, node slots, Slurm scripts."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from trainguard.cli import main
from trainguard.runtime.hang import HangPolicy
from trainguard.runtime.heartbeat import HeartbeatWriter, read_heartbeats
from trainguard.runtime.lifecycle import DEADLINE, KILL_SWITCH, NONE, SIGNAL, Lifecycle, LifecycleConfig, deadline_near
from trainguard.runtime.nodes import NodePool, SlurmNodes
from trainguard.runtime.slurm import JobSpec, render_job_script, time_limit_minutes


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def trainguard(capsys):
    """The ``trainguard`` command run in this process (the same parser and code as the script)."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def test_deadline_leaves_room_for_one_step_and_the_save():
    assert not deadline_near(now=100, deadline=200, step_seconds=10, save_seconds=50, margin=0)
    assert deadline_near(now=100, deadline=200, step_seconds=10, save_seconds=50, margin=40)
    assert deadline_near(now=150, deadline=200, step_seconds=10, save_seconds=40, margin=0)


def test_local_reason_kill_switch_wins_over_signal_and_deadline(tmp_path):
    switch = tmp_path / "stop"
    life = Lifecycle(LifecycleConfig(kill_switch_path=str(switch), exit_duration_in_mins=1000.0))
    try:
        assert life.local_reason() == NONE
        life.deadline = time.time() - 1
        assert life.local_reason() == DEADLINE
        os.kill(os.getpid(), signal.SIGUSR1)
        assert life.signals.received == "SIGUSR1" and life.local_reason() == SIGNAL
        switch.touch()
        assert life.local_reason() == KILL_SWITCH
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)


def test_hang_policy():
    auto = HangPolicy(multiple=10, floor=60, startup=600)
    assert auto.timeout(longest_gap=2.0, started_training=True) == 60
    assert auto.timeout(longest_gap=30.0, started_training=True) == 300
    assert auto.timeout(longest_gap=30.0, started_training=False) == 600
    fixed = HangPolicy(fixed=5, startup=600)
    assert fixed.timeout(100.0, True) == 5 and fixed.timeout(0.0, False) == 600


def test_heartbeats_are_rewritten_and_read_back(tmp_path):
    writer = HeartbeatWriter(tmp_path, rank=3)
    writer.beat("train", 4)
    writer.beat("step", 5)
    writer.beat("step", 6)
    (tmp_path / "heartbeats" / "rank_9.json").write_text("{torn")
    beats = read_heartbeats(tmp_path)
    assert list(beats) == [3]
    beat = beats[3]
    assert (beat.phase, beat.step, beat.resumed, beat.pid) == ("step", 6, 4, os.getpid())
    assert set(beat.marks) == {"init", "train", "first_step"} and beat.longest_gap >= 0
    assert not [p for p in (tmp_path / "heartbeats").iterdir() if p.name.startswith(".")]


def test_node_pool_spare_takes_the_excluded_slot():
    pool = NodePool(["n0", "n1", "n2", "n3"], nnodes=2)
    assert pool.slots == ["n0", "n1"] and pool.spares == ["n2", "n3"]
    assert pool.exclude("n1", "faulty") == "n2"
    assert pool.slots == ["n0", "n2"] and pool.spares == ["n3"]
    assert pool.exclude("n0", "faulty") == "n3" and pool.slots == ["n3", "n2"]
    assert pool.exclude("n2", "faulty") is None and not pool.complete
    assert NodePool(["n0", "n1", "n2"], nnodes=2, excluded={"n0": "x"}).slots == ["n1", "n2"]


def test_slurm_node_agent_command():
    command = SlurmNodes(["a", "b"]).command("b", ["python", "-m", "trainguard", "train"])
    assert command[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=b"]
    assert "--output=%x-%j-%N.out" in command and command[-4:] == ["python", "-m", "trainguard", "train"]


def test_slurm_time_limits():
    assert time_limit_minutes("100:00:00") == 6000
    assert time_limit_minutes("4-04:00:00") == 6000
    assert time_limit_minutes("90") == 90
    assert time_limit_minutes("1:30") == 1.5
    with pytest.raises(ValueError):
        time_limit_minutes("soon")


def test_job_script_has_the_reference_pieces():
    text = render_job_script(JobSpec(job_name="tr11", run_dir="/runs/tr11", train_args=["--steps", "100"],
                                     python="/usr/bin/python3", nodes=48, spare_nodes=4, nproc_per_node=8,
                                     excluded=["iam34", "iam35"]))
    lines = text.splitlines()
    for expected in ("#SBATCH --nodes=52", "#SBATCH --signal=USR1@90", "#SBATCH --array=1-10%1",
                     "#SBATCH --output=%x-%j-%N.out", "#SBATCH --exclude=iam34,iam35"):
        assert expected in lines
    assert "lifecycle.exit_duration_in_mins=5990" in text  # the reference's 99:50 for a 100 h limit
    assert "-m trainguard run --launcher slurm --run-dir /runs/tr11 --nnodes 48 --spare-nodes 4" in text
    # exec'd: the batch step's process is the supervisor, so scancel -b and --signal=B:... reach it
    assert any(line.startswith('exec "$PYTHON" -m trainguard run ') for line in lines)
    assert "-m trainguard train --nproc 8 --run-dir /runs/tr11" in text


def test_sbatch_command_reads_the_excluded_nodes(trainguard, tmp_path):
    run = tmp_path / "run"
    (run / "nodes").mkdir(parents=True)
    (run / "nodes" / "excluded.json").write_text(json.dumps([{"node": "gpu07", "reason": "exit 17"}]))
    proc = trainguard("slurm", "sbatch", "--run-dir", str(run), "--nodes", "2", "--spare-nodes", "1",
                      "--time", "2:00:00", "--", "--steps", "50")
    assert proc.returncode == 0, proc.stderr
    script = (run / "run.slurm").read_text()
    assert "#SBATCH --exclude=gpu07" in script and "#SBATCH --time=2:00:00" in script
    assert "exit_duration_in_mins=110" in script and script.rstrip().endswith("--steps 50")
    bad = trainguard("slurm", "sbatch", "--run-dir", str(run), "--", "--nproc", "2")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--nproc" in bad.stderr


def _stale_run(tmp_path):
    run = tmp_path / "stale"
    HeartbeatWriter(run, rank=0).beat("step", 7)
    beat_file = run / "heartbeats" / "rank_0.json"
    record = json.loads(beat_file.read_text())
    record["time"] -= 3600
    beat_file.write_text(json.dumps(record))
    return run


def test_watch_alerts_once_on_a_stale_run(trainguard, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue: the machine's Slurm, if any, stays out of it
    run = _stale_run(tmp_path)
    marker = tmp_path / "alerts"
    proc = trainguard("watch", str(run), "--once", "--stale-after", "60", "--alert-cmd", f"echo $RUN >> {marker}")
    assert proc.returncode == 1
    assert "***ALERT: stale is not RUNNING or SCHEDULED!***" in proc.stdout
    assert marker.read_text().strip() == str(run)
    HeartbeatWriter(run, rank=0).beat("step", 8)  # progressing again: no alert
    fresh = trainguard("watch", str(run), "--once", "--stale-after", "60", "--alert-cmd", f"echo again >> {marker}")
    assert fresh.returncode == 0 and "ALERT" not in fresh.stdout and marker.read_text().count("\n") == 1


def test_watch_loop_runs_the_alert_command_once_per_incident(tmp_path):
    import subprocess
    import sys

    from helpers.runs import worker_env

    run = _stale_run(tmp_path)
    marker = tmp_path / "alerts"
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "watch", str(run), "--interval", "0.1",
                             "--stale-after", "60", "--alert-cmd", f"echo x >> {marker}"],
                            env=worker_env(PATH=str(tmp_path)), stdout=subprocess.PIPE, text=True)  # no squeue
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # several more checks of the same incident
    finally:
        proc.terminate()
    out = proc.communicate()[0]
    assert out.count("***ALERT: stale is not RUNNING or SCHEDULED!***") == 1
    assert marker.read_text() == "x\n"


@pytest.mark.parametrize("args, message", [
    (["watch", "/nonexistent/run"], "run directory /nonexistent/run does not exist"),
    (["run", "--run-dir", "/tmp/x", "--", "no-such-command-xyz"], "command not found: 'no-such-command-xyz'"),
    (["run", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
    (["run", "--run-dir", "/tmp/x"], "no command to run"),
    (["killswitch", "/nonexistent/dir/stop"], "directory /nonexistent/dir does not exist"),
    (["train", "--max-restarts", "-1"], "expected an integer ≥ 0"),
])
def test_bad_input_is_one_clear_error(trainguard, args, message):
    proc = trainguard(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_killswitch_arms_and_clears(trainguard, tmp_path):
    switch = tmp_path / "stop"
    assert trainguard("killswitch", str(switch)).returncode == 0 and switch.exists()
    assert json.loads(switch.read_text())["armed_by"]
    assert trainguard("killswitch", str(switch), "--clear").returncode == 0 and not switch.exists()


def test_run_passes_on_codes_it_must_not_restart(trainguard, tmp_path):
    proc = trainguard("run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "3", "--", "sh", "-c", "exit 3")
    assert proc.returncode == 3
    from helpers.runs import events

    assert len(events(tmp_path / "run", "incarnation_started")) == 1 and events(tmp_path / "run", "restart") == []


def test_run_gives_up_on_a_command_that_never_makes_progress(trainguard, tmp_path):
    run = tmp_path / "run"
    proc = trainguard("run", "--run-dir", str(run), "--max-restarts", "5", "--backoff", "0", "--", "false")
    assert proc.returncode == 1
    assert "giving up: crash loop: 2 failures in a row without a new step" in proc.stderr
    assert proc.stderr.count("trainguard supervisor:   #") == 2
    proc = trainguard("run", "--run-dir", str(run), "--max-restarts", "1", "--backoff", "0", "--crash-loop", "5",
                      "--", "false")
    assert proc.returncode == 1 and "giving up: --max-restarts 1 used up" in proc.stderr


def test_a_run_not_restarted_still_says_in_one_line_what_ended_it(trainguard, tmp_path):
    """``--max-restarts 0`` (``trainguard train``'s default): no supervision lines, but one line naming the failure
    and the code; before, a rank killed by a signal ended the command with exit 1 and nothing said."""
    proc = trainguard("run", "--run-dir", str(tmp_path / "run"), "--max-restarts", "0", "--", "sh", "-c", "kill -9 $$")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("trainguard supervisor:")]
    assert lines == ["trainguard supervisor: agent on node0 exited -9: exit 1, not restarted (--max-restarts 0)"], \
        proc.stderr
