"""trainguard under a real Slurm (the ``slurm`` fixture: munged, slurmctld, eight slurmd logical nodes on
this host): job arrays that run out of time and resume, every way of cancelling a job, a hang ending
its job step, node exclusion with a spare, the watchdog's alerts, and the kill switch.

Jobs run concurrently (a node each), so the module takes a few minutes, most of it
time limits running out. Steps are slowed by a persistent ``hang`` fault of a fixed length, so that a
run spans several tasks of its array whatever the load of the machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.runs import TINY, assert_same_tensors, events, finish_session, ok, worker_env
from trainguard.runtime.heartbeat import read_heartbeats

SLOW_STEPS = "hang:rank=0,step=1,seconds=1,persistent=1"  # every step takes at least 1 s
ARRAY_STEPS = 42
# Tasks 1 and 2 of the array run on ARRAY_NODE, where every step takes ≥ 2 s; the test moves task 3 to
# another node, where nothing slows it: what it trains need not outlast a time limit
ARRAY_NODE = "n3"
ARRAY_SLOW_STEPS = f"hang:rank=0,step=1,seconds=2,persistent=1,node={ARRAY_NODE}"
# The array's --signal=USR1@55: once the test has cut a task's limit to 1 minute, the warning is due
# (the task has run for more than 5 s) and the controller sends it at its next check, within about
# 30 s: a task trains at most ~2 + 16 steps (18 measured), two tasks at most ~36, fewer than
# ARRAY_STEPS, and the third finishes the rest (at 2 s a step on ARRAY_NODE, it took 84 s of the
# test's 119: ~25 steps measured)
# (with USR1@30 the warning came 30 to 60 s after a task's start, and the third task trained what two
# such tasks might have)
ARRAY_SIGNAL_SECONDS = 55
HANG_TIMEOUT = 30


def sbatch(slurm, tmp_path: Path, name: str, steps: int, *train_args: str, time_limit: str = "10:00",
           array: int = 1, nodes: int = 1, spares: int = 0, margin: float = 1.0, signal_seconds: int = 30,
           faults: str | None = SLOW_STEPS, options: tuple[str, ...] = ()) -> tuple[Path, str]:
    """Writes and submits the job script as users do; returns the run directory and the job id."""
    run = tmp_path / name
    command = [sys.executable, "-m", "trainguard", "slurm", "sbatch", "--run-dir", str(run), "--job-name", name,
               "--nodes", str(nodes), "--spare-nodes", str(spares), "--nproc-per-node", "1",
               "--time", time_limit, "--signal-seconds", str(signal_seconds), "--array", str(array),
               "--exit-margin-mins", f"{margin:g}", "--max-restarts", "3", *options, "--submit",
               "--", "--steps", str(steps), *TINY, "--save-interval", "1000", *train_args]
    env = slurm.env(OMP_NUM_THREADS="1", **({"TRAINGUARD_FAULTS": faults} if faults else {}))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    return run, re.search(r"Submitted batch job (\d+)", done.stdout).group(1)


def wait_for_step(run: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        beats = read_heartbeats(run)
        if beats and all(beat.phase in ("step", "save") and beat.step >= step for beat in beats.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"{run} did not reach step {step} in {timeout:.0f}s")


def finished(run: Path) -> dict:
    ends = events(run, "supervisor_finished") + events(run, "supervisor_gave_up")
    assert ends, f"no supervisor end in {run}"
    return ends[-1]


def wait_until_done(slurm, job: str, timeout: float) -> None:
    slurm.wait_for_state(job, ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"), timeout)


# ------------------------------------------------------------------------------------ cancelling
CANCELS = {
    "scancel": ("scancel", "{job}"),  # SIGTERM to every step and the batch step (then SIGKILL after KillWait)
    "scancel-TERM": ("scancel", "--signal=TERM", "{job}"),  # to the steps only: the ranks, not the supervisor
    "scancel-b-USR1": ("scancel", "-b", "--signal=USR1", "{job}"),  # to the batch step only: the supervisor
    "scancel-USR1": ("scancel", "--signal=USR1", "{job}"),  # to the steps: what --signal=USR1@T does
}


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Every long job of the module, submitted at once so that they run at the same time."""
    where = tmp_path_factory.mktemp("slurm_jobs")
    submitted = {"where": where}
    # first, so that n1 and n2 are free: n1 holds slot 0 (nodes are allocated in order) and its rank dies
    # at every start there
    submitted["spare"] = sbatch(slurm, where, "spare", 6, faults="kill:rank=0,step=2,persistent=1,node=n1",
                                spares=1, options=("--sbatch-option=--nodelist=n1,n2",))
    # three tasks; the test shortens the first two's time limits while they train
    submitted["array"] = sbatch(slurm, where, "array", ARRAY_STEPS, array=3, faults=ARRAY_SLOW_STEPS,
                                signal_seconds=ARRAY_SIGNAL_SECONDS,
                                options=(f"--sbatch-option=--nodelist={ARRAY_NODE}",))
    # the array's uninterrupted twin, trained meanwhile (the jobs mostly wait on their time limits)
    reference = where / "array_reference"
    submitted["array_reference"] = reference, subprocess.Popen(
        [sys.executable, "-m", "trainguard", "train", "--nproc", "1", "--steps", str(ARRAY_STEPS), "--run-dir",
         str(reference), *TINY, "--save-interval", "1000"], env=worker_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    submitted["hang"] = sbatch(slurm, where, "hang", 12, "--save-interval", "3",
                               faults=f"{SLOW_STEPS};hang:rank=0,step=5", options=("--hang-timeout", str(HANG_TIMEOUT)))
    for variant in CANCELS:  # cancelled once running (``cancel_each_once_running``), long before the last step
        submitted[variant] = sbatch(slurm, where, variant, 2000)
    # short jobs, last: they wait for the first node freed (the spare's job's), then take seconds, while
    # the array test waits on its time limits
    switch = where / "KILL"
    subprocess.run([sys.executable, "-m", "trainguard", "killswitch", str(switch)], check=True, capture_output=True)
    submitted["killed"] = sbatch(slurm, where, "killed", 50, array=3, options=("--kill-switch", str(switch)))
    submitted["short"] = sbatch(slurm, where, "short", 3, array=3, faults=None)
    # the cancels are sent while the array test waits on its time limits, not after it (their test checks
    # the outcome): the watchdog's answer while the job ran comes back with them
    with ThreadPoolExecutor(max_workers=1) as pool:
        submitted["running_watch"] = pool.submit(cancel_each_once_running, slurm, submitted)
        yield submitted
    training = submitted["array_reference"][1]
    if training.poll() is None:  # its test failed before waiting for it
        os.killpg(training.pid, signal.SIGKILL)
        training.communicate()


# ------------------------------------------------------------------------------------ time limit
def move_off_the_array_node(slurm, task: str) -> None:
    """Lets the pending array task ``task`` run on any node but ARRAY_NODE. Done once task 2 runs: a task
    updated while the others are pending is split off the array and may start before them."""
    slurm.run("scontrol", "update", f"JobId={task}", "ReqNodeList=", f"ExcNodeList={ARRAY_NODE}")


def run_out_of_time(slurm, run: Path, job: str, task: int, before_the_cut=lambda: None) -> None:
    """Once array task ``task`` has resumed and trained two steps, cuts its time limit to one minute
    (Slurm's granularity): at its next check the controller sends the limit's USR1 warning (due
    ``ARRAY_SIGNAL_SECONDS`` before the limit) or ends it with SIGTERM, then SIGKILL after KillWait, as
    at any time limit. Done by the test so that the stops do not depend on the machine's load.
    ``before_the_cut`` runs while the task trains, before its limit is cut."""
    deadline = time.time() + 900
    while time.time() < deadline:
        started = events(run, "run_started")
        beats = read_heartbeats(run)
        if len(started) == task and beats and all(beat.phase == "step" and beat.step >= started[-1]["step"] + 2
                                                  for beat in beats.values()):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"task {task} of {job} never trained")
    before_the_cut()
    slurm.run("scontrol", "update", f"JobId={job}_{task}", "TimeLimit=1")
    # FAILED: the ranks stopped at the limit's USR1 warning and the job exited 16 before the SIGTERM
    slurm.wait_for_state(f"{job}_{task}", ("TIMEOUT", "FAILED"), 300)


def test_job_array_runs_out_of_time_twice_and_ends_bitwise_equal(slurm, jobs):
    steps = ARRAY_STEPS
    run, job = jobs["array"]
    run_out_of_time(slurm, run, job, 1)
    run_out_of_time(slurm, run, job, 2, before_the_cut=lambda: move_off_the_array_node(slurm, f"{job}_3"))
    slurm.wait_for_state(f"{job}_3", ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 1200)
    reference, training = jobs["array_reference"]
    ok(finish_session(training, 900, "the reference run"))
    ends = events(run, "supervisor_finished")
    assert [(e["exit_code"], e["outcome"]) for e in ends] == [(16, "stopped"), (16, "stopped"), (0, "finished")], ends
    stops = events(run, "lifecycle_stop")  # the limit's --signal=USR1 warning, or its SIGTERM
    assert [(e["reason"], e["exit_code"]) for e in stops] == [("signal", 16), ("signal", 16)], stops
    assert 0 < stops[0]["step"] < stops[1]["step"] < steps
    assert [e["step"] for e in events(run, "run_started")] == [0, stops[0]["step"], stops[1]["step"]]
    assert events(run, "restart") == []
    nodes = [e["nodes"] for e in events(run, "supervisor_started")]  # slowed where the limits ran out only
    assert nodes[:2] == [[ARRAY_NODE], [ARRAY_NODE]] and nodes[2] != [ARRAY_NODE], nodes
    assert_same_tensors(run / "checkpoints" / f"global_step_{steps}", reference / "checkpoints" / f"global_step_{steps}")
    states = [slurm.job_state(f"{job}_{task}") for task in (1, 2, 3)]
    assert states[0] in ("TIMEOUT", "FAILED") and states[1] in ("TIMEOUT", "FAILED") and states[2] == "COMPLETED"


# ------------------------------------------------------------------------------------ hang
def test_a_hang_under_slurm_ends_its_job_step_and_recovers_within_twice_the_timeout(slurm, jobs):
    timeout = HANG_TIMEOUT
    run, job = jobs["hang"]
    wait_until_done(slurm, f"{job}_1", 600)
    assert finished(run)["exit_code"] == 0, finished(run)
    hangs = events(run, "hang_detected")
    assert len(hangs) == 1 and hangs[0]["ranks_dumped"] == [0]
    assert "in _hang" in (Path(hangs[0]["dumps"]) / "rank_0.txt").read_text()  # dumped through Slurm (USR2)
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["reason"] == "hang"
    # trainguard's part (detection, ending the job step, restart, model build, load, first step) within
    # twice the timeout: before, the next srun waited for the hung step for ever; the interpreter's start
    # and imports (process_start) depend on the machine's load and are left out
    assert recovered[0]["parts"]["restart"] < timeout, recovered[0]
    assert recovered[0]["trainguard_seconds"] < 2 * timeout, recovered[0]
    assert slurm.job_state(f"{job}_1") == "COMPLETED"


# ------------------------------------------------------------------------------------ nodes
def test_a_failing_node_is_excluded_and_a_spare_takes_its_slot(slurm, jobs):
    run, job = jobs["spare"]
    wait_until_done(slurm, f"{job}_1", 600)
    end = finished(run)
    assert end["exit_code"] == 0, end
    excluded = events(run, "node_excluded")
    assert [(e["node"], e["spare"]) for e in excluded] == [("n1", "n2")]
    assert events(run, "spare_started")[0]["node"] == "n2"
    # the next job script keeps the excluded node out
    again = subprocess.run([sys.executable, "-m", "trainguard", "slurm", "sbatch", "--run-dir", str(run), "--",
                            "--steps", "6"], env=slurm.env(), capture_output=True, text=True, check=True)
    assert "#SBATCH --exclude=n1" in (run / "spare.slurm").read_text(), again.stdout


# ------------------------------------------------------------------------------------ cancelling
def cancel_each_once_running(slurm, jobs: dict) -> subprocess.CompletedProcess:
    """Cancels each job of ``CANCELS`` its own way once it has trained 3 steps; returns the watchdog's
    answer on the "scancel" job, asked while that job ran, just before its cancel."""
    running = None
    for variant in CANCELS:
        run, job = jobs[variant]
        wait_for_step(run, 3, timeout=600)
        if variant == "scancel":
            running = watch(slurm, run, variant)
        slurm.run(*(part.format(job=job) for part in CANCELS[variant]))
    return running


def test_every_scancel_saves_exits_16_and_is_recorded_as_a_stop(slurm, jobs):
    tmp_path = jobs["where"]
    cancels = {variant: jobs[variant] for variant in CANCELS}
    running = jobs["running_watch"].result()  # the watchdog while the "scancel" job ran (and, below, once it ended)
    assert running.returncode == 0 and "ALERT" not in running.stdout, running.stdout
    for variant, (run, job) in cancels.items():
        wait_until_done(slurm, f"{job}_1", 180)
        if variant == "scancel":
            after = watch(slurm, run, variant)
            assert after.returncode == 1 and f"***ALERT: {variant} is not RUNNING or SCHEDULED!***" in after.stdout
        end = finished(run)
        assert end["exit_code"] == 16 and end["outcome"] == "stopped", (variant, end)
        assert events(run, "restart") == [], variant
        ended = events(run, "incarnation_ended")
        assert len(ended) == 1 and ended[0]["failing_rank"] is None, (variant, ended)
        assert ended[0]["rank_exit_codes"] == {"0": 16}, variant
        stop = events(run, "lifecycle_stop")
        assert len(stop) == 1 and stop[0]["reason"] == "signal", variant
        assert (run / "checkpoints" / f"global_step_{stop[0]['step']}").is_dir(), variant
        log = "".join(path.read_text() for path in tmp_path.glob("*.out")
                      if re.fullmatch(rf"{re.escape(variant)}-\d+-.+\.out", path.name))
        assert f"array {job}_1" in log, variant  # the job's own log was read
        assert "failed" not in " ".join(line for line in log.splitlines() if "supervisor" in line), (variant, log)


# ------------------------------------------------------------------------------------ watch, kill switch
def watch(slurm, run: Path, name: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", "watch", str(run), "--once", "--stale-after", "1",
                           "--job-name", name], env={**slurm.env(), **env}, capture_output=True, text=True, timeout=120)


def test_watch_tells_a_held_job_and_a_failing_squeue_apart(slurm, tmp_path):
    run = tmp_path / "held"
    run.mkdir()
    done = slurm.run("sbatch", "--hold", "--job-name=held", "--wrap=true", "--output=/dev/null")
    job = done.stdout.split()[-1]
    try:
        held = watch(slurm, run, "held")
        assert held.returncode == 1 and "***ALERT: held is HELD (JobHeldUser)" in held.stdout, held.stdout
        broken = tmp_path / "broken.conf"
        # no controller on port 1; squeue retries the connection for MessageTimeout - 1 s (9 s at the
        # cluster's 10, measured), so this client's copy of the file allows 2 (1 s): the same failure, sooner
        unreachable = re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=1", slurm.conf.read_text())
        broken.write_text(re.sub(r"MessageTimeout=\d+", "MessageTimeout=2", unreachable))
        down = watch(slurm, run, "held", SLURM_CONF=str(broken))
        assert down.returncode == 1 and "squeue failed" in down.stdout and "HELD" not in down.stdout, down.stdout
    finally:
        slurm.run("scancel", job, check=False)
    gone = watch(slurm, run, "held")
    assert "***ALERT: held is not RUNNING or SCHEDULED!***" in gone.stdout
    # pending for an ordinary reason (its start time) is scheduled: no alert
    later = slurm.run("sbatch", "--begin=now+1hour", "--job-name=later", "--wrap=true", "--output=/dev/null")
    try:
        assert slurm.job_state(later.stdout.split()[-1]) == "PENDING"
        pending = watch(slurm, run, "later")
        assert pending.returncode == 0 and "ALERT" not in pending.stdout, pending.stdout
    finally:
        slurm.run("scancel", later.stdout.split()[-1], check=False)


def rest_of_array_settled(slurm, job: str, timeout: float = 30) -> dict[str, str]:
    """The array's task states once every record but task 1's (tasks 2 and 3, or one "2-3" record while
    pending) is CANCELLED, or ``timeout`` has passed: what the supervisor's cancel of the pending tasks
    leaves, waited for instead of a fixed wait."""
    deadline = time.time() + timeout
    while True:
        states = slurm.array_states(job)
        if all(state == "CANCELLED" for task, state in states.items() if task != "1") or time.time() > deadline:
            return states
        time.sleep(0.5)


def test_an_armed_kill_switch_ends_the_array_without_starting_ranks(slurm, jobs):
    run, job = jobs["killed"]  # submitted with the switch armed
    wait_until_done(slurm, f"{job}_1", 600)
    assert events(run, "incarnation_started") == [] and not (run / "heartbeats").exists()
    assert finished(run)["outcome"] == "nothing_to_do"
    states = rest_of_array_settled(slurm, job)
    assert states.get("1") == "COMPLETED" and all(states.get(t, "CANCELLED") == "CANCELLED" for t in "23"), states


def test_a_finished_run_cancels_the_rest_of_its_array(slurm, jobs):
    run, job = jobs["short"]
    slurm.wait_for_state(f"{job}_1", ("COMPLETED",), 900)
    assert finished(run)["exit_code"] == 0 and len(events(run, "supervisor_started")) == 1
    states = rest_of_array_settled(slurm, job)
    assert states.get("1") == "COMPLETED" and all(states.get(t, "CANCELLED") == "CANCELLED" for t in "23"), states
