"""The closure mode's guards and stops in live mode, on the documented user path (``trainguard run
--nproc 4 --config FILE -- python tests/helpers/live_loop.py --config FILE``: 4 gloo ranks, 2 replica
groups x 2, dropout, AdamW with a ``OneCycleLR``, the loop's own ``StepsSeen`` as ``stateful``, durable
checkpoints every 5 steps), ``guards.skip`` on with an absolute threshold:

- a gradient spike (the drill's ``spike:step=4``) and a NaN (``nan:step=7``, rank 0's by default: every
  rank's in the sum) are skipped by every rank at steps 4 and 7, the run goes on, and ends with every
  rank's parameters and optimizer state bitwise those of a fault-free run that skips steps 4 and 7 by
  replay (``guards.skip.replay_steps``), and so does the same run with rank 3 SIGKILLed between the two
  (its group rejoins with the guards', the scheduler's and the loop's object's state: every rank's
  final state, those included, the fault-free run's); the same script in the closure mode
  (``helpers/user_loop_closure.py``, the same gradients summed by the same tree) measures every step's
  loss and norm within 1e-5 of live mode's (live mode sums the norm's squares by rows, the same for any
  layout, the closure mode by parameter: the clip's factor, and so the trajectory, differ in the last
  bits), and skips the same steps;
- a spike at every step from 3 with ``count_threshold: 2``: every rank aborts at step 4 with the
  reference's line, exit 3, and no rank is replaced;
- ``train.exit_at_step: 6``: the quorum saves step 6 and ends with exit 0; the same command without it
  resumes there and ends bitwise equal to the run that never stopped (guards', scheduler's and loop
  object's state included: they ride in the durable checkpoint);
- the kill switch created mid-run: the quorum stops at its next step boundary, saved, exit 0, with the
  closure mode's line; present at the start, no rank starts;
- the time limit (``lifecycle.exit_duration_in_mins``) near: saved, exit 16.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from helpers.runs import events as events_of, finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.fs.layout import extra_state_name
from trainguard.live.compare import bitwise_differences, replica_differences, run_differences
from trainguard.live.files import events_path, final_path
from trainguard.report.facts import read_run
from trainguard.report.summary import status_rows
from trainguard.runtime.heartbeat import read_heartbeats

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "helpers" / "live_loop.py"
CLOSURE_TWIN = ROOT / "tests" / "helpers" / "user_loop_closure.py"
STEPS, WORLD, SPIKE_AT, NAN_AT, THRESHOLD = 10, 4, 4, 7, 50.0
# guards.health on the first layer's gradient norm (live_loop.py's stand-in embedding): above it at step 5
# (0.626 in these runs), below at steps 6 and 10 (0.553, 0.557)
EMBEDDING_THRESHOLD = 0.6
FAULTS = f"faults=spike:step={SPIKE_AT},factor=10000; nan:step={NAN_AT}"
SKIPPED = [SPIKE_AT, NAN_AT]
TIMEOUT_S = 240
LOG_INTERVAL = 3  # train.log_interval: the step line at steps 3, 6, 9 and the last
# every run steps a OneCycleLR and keeps the loop's StepsSeen as stateful (live/state.py)
SCRIPT_FLAGS = ["--one-cycle", "--seen"]


def _config(root: Path) -> Path:
    config = root / "live_guards.yaml"
    if config.exists():  # written once: a rewrite could be read half-written by a run still going (launched)
        return config
    config.write_text(EXAMPLE.with_suffix(".yaml").read_text()
                      .replace("steps: 60", f"steps: {STEPS}, log_interval: {LOG_INTERVAL}")
                      + "checkpoint: {save_interval: 5}\n"
                      + f"guards: {{local_norm: true, skip: {{enabled: true, threshold: {THRESHOLD}}}, "
                      + f"health: {{enabled: true, embedding_threshold: {EMBEDDING_THRESHOLD}}}}}\n")
    return config


def _start(run_dir: Path, config: Path, *sets: str):
    args = [arg for item in sets for arg in ("--set", item)]
    return warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir),
                                *args, "--", sys.executable, str(EXAMPLE), "--config", str(config), *SCRIPT_FLAGS],
                               worker_env())


def _live(run_dir: Path, config: Path, *sets: str) -> subprocess.CompletedProcess:
    return finish_session(_start(run_dir, config, *sets), TIMEOUT_S, f"the live run {run_dir.name}")


def _committed_steps(run_dir: Path) -> list[int]:
    return [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed]


def _trained_state(run_dir: Path, rank: int) -> dict:
    state = safe_torch_load(final_path(run_dir, rank))
    return {"model": state["model"], "optimizer": state["optimizer"]}


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_guards")


@pytest.fixture(scope="module")
def launched(root) -> dict[str, Future]:
    """The spiked, replayed, killed and aborted runs, started at once in threads of their own (most of a run is
    waits they share), each test waiting for its own. Their heartbeat timeout is long: 16 ranks starting together
    on a small machine can be silent for longer than the default 10 s (none of them drills a hang)."""
    config = _config(root)  # written here, before any thread reads it
    patient = "fault_tolerance.hang_s=60"
    runs = {"spiked": (FAULTS,), "replayed": (f"guards.skip.replay_steps={SKIPPED}",),
            "killed": (f"{FAULTS}; kill:rank=3,step=5",),
            "aborted": ("faults=spike:step=3,factor=10000,persistent=1", "guards.skip.count_threshold=2")}
    warm_server()  # the session's server made here, not by several threads at once
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        yield {name: pool.submit(_live, root / name, config, *sets, patient) for name, sets in runs.items()}


@pytest.fixture(scope="module")
def spiked(root, launched):
    return root / "spiked", _ok(launched["spiked"].result())


@pytest.fixture(scope="module")
def replayed(root, launched):
    _ok(launched["replayed"].result())
    return root / "replayed"


def test_a_gradient_spike_is_skipped_by_every_rank_and_the_run_goes_on(spiked):
    run_dir, done = spiked
    skips = events_of(run_dir, "data_skip")  # one report each, by the quorum's first member
    assert [(e["step"], e["nan"]) for e in skips] == [(SPIKE_AT, False), (NAN_AT, True)]
    for rank in range(WORLD):  # live_step counts from 0: index 3 is the closure mode's step 4
        steps = [e for e in events_of(run_dir, "live_step") if e["rank"] == rank]
        assert [e["step"] + 1 for e in steps if e["skipped"]] == SKIPPED, rank
        assert len(steps) == STEPS
    assert "ranks replaced: none" in done.stdout
    assert (f"opt_global_step: {SPIKE_AT - 1}, skip_data_grad_norm_threshold: {THRESHOLD!r}, is_skip: [ True]"
            in done.stdout)
    assert f"of step {SPIKE_AT} has been 1 consecutive times greater than threshold: {THRESHOLD!r}" in done.stdout
    assert replica_differences(run_dir, WORLD, 2) == {}
    assert _committed_steps(run_dir) == [5, 10]


def test_the_spiked_run_ends_bitwise_as_a_run_that_skips_the_same_step_by_replay(spiked, replayed):
    run_dir, _ = spiked
    for rank in range(WORLD):
        assert bitwise_differences(_trained_state(run_dir, rank), _trained_state(replayed, rank)) == [], rank


@pytest.fixture(scope="module")
def killed(root, launched):
    return root / "killed", _ok(launched["killed"].result())


def test_a_rank_killed_between_the_skips_rejoins_with_the_guards_state_and_the_run_ends_bitwise(root, spiked, killed):
    """Rank 3 SIGKILLed after step 5 (the spike of step 4 skipped, the NaN of step 7 to come): its group
    rejoins with a live peer's guards' state (skipped steps, the streak, the data-skip window), the
    scheduler's and the loop's counter's besides the model and optimizer, and every rank ends with the
    spiked run's whole final state, those included."""
    run_dir, _ = spiked
    _, done = killed
    assert "ranks replaced: [3]" in done.stdout
    assert [e["step"] for e in events_of(root / "killed", "data_skip")] == SKIPPED
    assert run_differences(run_dir, root / "killed", WORLD) == {}
    for rank in range(WORLD):  # the replacement of rank 3 too: its loop asked for the steps after its join only
        final = safe_torch_load(final_path(root / "killed", rank))
        assert final["scheduler"]["last_epoch"] == STEPS - len(SKIPPED), rank  # it stands still on a skipped step
        assert final["stateful"]["seen"] == {"steps": STEPS, "last": STEPS - 1}, rank


@pytest.fixture(scope="module")
def hung(root, launched):
    # the stall watch and the heartbeat timeout short: the hung rank costs the run seconds, not 10 s; so it runs
    # once the runs started together ended, as their load could silence a rank for longer
    wait(launched.values())
    return root / "hung", _ok(_live(root / "hung", _config(root), f"{FAULTS}; hang:rank=1,step=6",
                                    "fault_tolerance.stall_s=2", "fault_tolerance.hang_s=4"))


def test_the_hang_drill_stops_its_rank_which_is_found_killed_and_replaced_and_the_run_ends_bitwise(root, spiked, hung):
    """``hang:rank=1,step=6``, the closure mode's drill: rank 1 stops (alive, silent) as it starts step 6;
    where the closure mode's supervisor restarts the job, live mode's lighthouse finds it, the other group
    goes on, the launcher kills and replaces rank 1 (once in the run: the replacement does not hang
    again), its group rejoins, and every rank ends with the spiked run's whole state."""
    run_dir, done = hung
    assert "ranks replaced: [1]" in done.stdout
    [fired] = [e for e in events_of(run_dir, "fault_injected") if e["fault"] == "hang"]
    assert (fired["rank"], fired["step"], fired["action"]) == (1, 6, "hang")
    assert [e["target"] for e in events_of(run_dir, "live_hung")] == [1]
    assert [e["step"] for e in events_of(run_dir, "data_skip")] == SKIPPED
    assert run_differences(spiked[0], run_dir, WORLD) == {}


def test_every_live_rank_writes_its_heartbeat_file_and_status_shows_the_finished_run(root, killed):
    """``lifecycle.heartbeats`` (on by default) in live mode: each rank's ``heartbeats/rank_R.json``, the
    closure mode's file, ends at the last step with exit 0, rank 3's written by its replacement (its
    SIGKILLed process never wrote an exit); ``trainguard status`` reads the run as finished at that step."""
    run_dir = root / "killed"
    beats = read_heartbeats(run_dir)
    assert sorted(beats) == list(range(WORLD))
    assert {(beat.phase, beat.step, beat.exit_code) for beat in beats.values()} == {("exit", STEPS, 0)}
    first_pid = next(event["pid"] for event in events_of(run_dir, "live_start") if event["rank"] == 3)
    assert beats[3].pid != first_pid and beats[3].resumed > 0  # the replacement, which joined mid-run
    rows = dict(status_rows(read_run(run_dir)))
    assert rows["state"] == "finished" and rows["step"] == str(STEPS)
    assert rows["heartbeats"].count(f"step {STEPS} exit") == WORLD


def test_every_ranks_copy_of_the_run_state_in_a_checkpoint_is_the_same(root, killed):
    """A resume at another world size reads rank 0's copy of the run state (the guards', the scheduler's,
    the loop's objects): every rank's is the same in each durable checkpoint, the replacement's after its
    join included, so rank 0's is the quorum's."""
    checkpoints = [info.path for info in list_checkpoints(root / "killed" / "checkpoints") if info.committed]
    assert checkpoints
    for checkpoint in checkpoints:
        copies = [safe_torch_load(checkpoint / extra_state_name(WORLD, rank))["stateful"] for rank in range(WORLD)]
        assert set(copies[0]) >= {"live_guards", "scheduler", "seen"}, checkpoint
        for rank, copy in enumerate(copies[1:], start=1):
            assert bitwise_differences(copies[0], copy) == [], (checkpoint, rank)


def _health_records(run_dir: Path) -> dict[int, int]:
    """Step -> ``is_health`` of each record in ``health_ckpts.json``, checked against the manifest's."""
    records = json.loads((run_dir / "checkpoints" / "health_ckpts.json").read_text())
    health = {int(r["ckpt_name"].removeprefix("global_step_")): r["is_health"] for r in records}
    for info in list_checkpoints(run_dir / "checkpoints"):
        assert info.manifest.health["is_health"] == health[info.step], info.step
    return health


def test_every_durable_save_records_its_health_from_the_summed_gradients_embedding_norm(spiked, killed):
    """``guards.health`` in live mode: each save's verdict is the norm of the stand-in embedding's rows of
    the saved step's summed gradient (every rank's alike: no collective of its own), the same figure every
    ``live_step`` event carries (as the closure mode's ``step`` events do with ``guards.monitor``)."""
    for run_dir, saved in ((spiked[0], [5, 10]), (killed[0], [10])):  # the killed run's save of 5 was cut
        steps = {e["step"] + 1: e["embedding_local_norm"] for e in events_of(run_dir, "live_step") if e["rank"] == 0}
        assert _committed_steps(run_dir) == saved and sorted(_health_records(run_dir)) == saved, run_dir.name
        assert _health_records(run_dir) == {step: int(steps[step] > EMBEDDING_THRESHOLD) for step in saved}
        assert all("embedding_local_norm" in e for e in events_of(run_dir, "live_step"))
    assert _health_records(spiked[0]) == {5: 1, 10: 0}  # step 5's above the threshold


def test_each_rank_records_its_shards_local_gradient_norms_and_a_groups_make_the_global_norm(spiked):
    """``guards.local_norm`` in live mode: every rank, every step, the norm of each parameter's rows it holds
    of the judged (summed, unclipped) gradient, as the closure mode's ``local_norm`` event; the two ranks of a
    group hold the rows of the whole, so their squares add up to the step's global norm, and the replicas of a
    shard (ranks 0 and 2, 1 and 3) record the same norms."""
    run_dir, _ = spiked
    local = {(e["step"], e["rank"]): e["norms"] for e in events_of(run_dir, "local_norm")}
    assert sorted(local) == [(step, rank) for step in range(1, STEPS + 1) for rank in range(WORLD)]
    norms = {e["step"] + 1: e["global_norm"] for e in events_of(run_dir, "live_step") if e["rank"] == 0}
    for step in range(1, STEPS + 1):
        assert local[step, 0] == local[step, 2] and local[step, 1] == local[step, 3], step
        # a NaN is written as its text
        squares = sum(float(value) ** 2 for rank in (0, 1) for value in local[step, rank].values())
        if step == NAN_AT:
            assert math.isnan(squares) and math.isnan(float(norms[step]))
        else:
            assert math.sqrt(squares) == pytest.approx(norms[step], rel=1e-5), step
    assert local[SPIKE_AT, 0]["0.weight"] > 100 * local[SPIKE_AT - 1, 0]["0.weight"]  # the drill's spike, seen


def _step_lines(output: str) -> dict[int, str]:
    """The closure mode's step lines in ``output``, by step, without the step's time (each run's own)."""
    lines = [line[line.index("step: ["):] for line in output.splitlines() if "step: [" in line]
    return {int(line.split("[")[1].split("/")[0]): re.sub(r"per_step_time: \d+ms, ", "", line) for line in lines}


def test_the_closure_mode_skips_the_same_steps_on_the_same_gradients(root, spiked):
    run_dir, done = spiked
    closure_dir = root / "closure"
    done_closure = subprocess.run([sys.executable, str(CLOSURE_TWIN), "--config", str(_config(root)), "--run-dir",
                           str(closure_dir), "--set", FAULTS.replace("; ", ";"), *SCRIPT_FLAGS],
                          env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    _ok(done_closure)
    # every step's verdict the live run's, its loss and norm within 1e-5 (live mode sums the micro-batches
    # by a fixed tree and the norm by rows, the closure mode in micro-batch order and by parameter)
    def verdicts(events: list[dict], first: int) -> list[tuple]:
        return [(e["step"] + first, e["skipped"]) for e in events]

    closure_steps = events_of(closure_dir, "step")
    live_steps = [e for e in events_of(run_dir, "live_step") if e["rank"] == 0]
    assert verdicts(closure_steps, 0) == verdicts(live_steps, 1) and len(live_steps) == STEPS
    for closure, live in zip(closure_steps, live_steps):
        for key in ("loss", "global_norm", "embedding_local_norm"):  # a NaN is written as its text
            expected, found = float(closure[key]), float(live[key])
            assert (math.isnan(expected) and math.isnan(found)) or found == pytest.approx(expected, rel=1e-5), key
    assert [e["step"] for e in events_of(closure_dir, "data_skip")] == SKIPPED
    # train.log_interval: the closure mode's step lines, written once (by the quorum's first member) at the same
    # steps, with the same skip counts and rate; loss and norm to their printed digits (within 1e-5, above)
    live_lines, closure_lines = _step_lines(done.stdout + done.stderr), _step_lines(done_closure.stdout + done_closure.stderr)
    assert sorted(live_lines) == sorted(closure_lines) == [3, 6, 9, 10]
    assert sum("step: [" in line for line in (done.stdout + done.stderr).splitlines()) == 4
    numbers = re.compile(r"[-+]?(?:\d+\.\d+(?:e[-+]\d+)?|nan|inf)")
    for step, line in live_lines.items():
        assert numbers.sub("#", line) == numbers.sub("#", closure_lines[step]), (line, closure_lines[step])
        for found, expected in zip(numbers.findall(line), numbers.findall(closure_lines[step])):
            assert found == expected or abs(float(found) - float(expected)) <= 0.0011, (line, closure_lines[step])


def test_consecutive_spikes_abort_every_rank_with_exit_3_and_no_rank_is_replaced(root, launched):
    run_dir = root / "aborted"
    done = launched["aborted"].result()
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    line = (f"ValueError: Current global norm [{events_of(run_dir, 'data_skip_abort')[0]['global_norm']:.6f}] of step 4 "
            f"has been 2 consecutive times greater than threshold {THRESHOLD!r}, stop training...")
    assert f"trainguard: error: [rank 0] {line}" in done.stderr
    assert "live run aborted by the data-skip guard: exit 3" in done.stdout
    assert len(events_of(run_dir, "data_skip_abort")) == 1
    assert not events_of(run_dir, "live_exit") and len(events_of(run_dir, "live_start")) == WORLD
    assert not any(final_path(run_dir, rank).exists() for rank in range(WORLD))


def test_exit_at_step_saves_and_ends_with_exit_0_and_the_run_resumes_bitwise(root, replayed):
    run_dir, config = root / "planned", _config(root)
    replay = f"guards.skip.replay_steps={SKIPPED}"
    stopped = _ok(_live(run_dir, config, replay, "train.exit_at_step=6"))
    assert "run exit_at_step at step 6" in stopped.stdout
    assert [(e["step"], e["reason"]) for e in events_of(run_dir, "run_finished")] == [(6, "exit_at_step")]
    assert _committed_steps(run_dir) == [5, 6]
    assert not any(final_path(run_dir, rank).exists() for rank in range(WORLD))
    resumed = _ok(_live(run_dir, config, replay))
    assert f"live run resumes from {run_dir / 'checkpoints' / 'global_step_6'}" in resumed.stdout
    assert run_differences(replayed, run_dir, WORLD) == {}  # the guards' state too: it rides in the checkpoint


def test_a_checkpoint_the_corrupt_drill_damaged_is_passed_over_at_the_resume_which_ends_bitwise(root, replayed):
    """``corrupt:step=6,file=*.distcp``, the closure mode's drill: the quorum's first member damages the
    durable checkpoint of step 6 once committed (here the stop's, ``train.exit_at_step: 6``); the next
    start (``--resume auto``) fails its verification, resumes from step 5 instead and ends bitwise equal
    to the run that never stopped."""
    run_dir, config = root / "corrupted", _config(root)
    # health off: step 5's checkpoint is above EMBEDDING_THRESHOLD, which the resume would pass over too
    replay, no_health = f"guards.skip.replay_steps={SKIPPED}", "guards.health.enabled=false"
    _ok(_live(run_dir, config, replay, no_health, "train.exit_at_step=6", "faults=corrupt:step=6,file=*.distcp"))
    [damaged] = events_of(run_dir, "fault_injected")
    assert (damaged["fault"], damaged["step"]) == ("corrupt", 6) and damaged["files"]
    resumed = _ok(_live(run_dir, config, replay, no_health))
    assert f"live run resumes from {run_dir / 'checkpoints' / 'global_step_5'}" in resumed.stdout
    differences = run_differences(replayed, run_dir, WORLD)  # but the last step's embedding norm: health is off
    assert all(difference.startswith("/committed/embedding_norm: None != ")
               for rank_differences in differences.values() for difference in rank_differences), differences


def test_the_kill_switch_stops_the_quorum_at_a_saved_boundary_and_at_start_starts_nothing(root):
    run_dir, switch = root / "switched", root / "switch"
    # health off: the early step it saves is above EMBEDDING_THRESHOLD, and the second start's resume point
    # (chosen before the kill switch is looked at) would be no healthy checkpoint: exit 4
    no_health = "guards.health.enabled=false"
    proc = _start(run_dir, _config(root), f"lifecycle.kill_switch_path={switch}", no_health)
    deadline = time.monotonic() + TIMEOUT_S
    while not (events_path(run_dir).exists() and events_of(run_dir, "live_step")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before its first step"
        time.sleep(0.02)
    # running: ``trainguard status`` finds it live from its ranks' heartbeat files (lifecycle.heartbeats)
    running = read_run(run_dir)
    assert running.state == "live" and sorted(beat.rank for beat in running.heartbeats) == list(range(WORLD))
    assert {beat.phase for beat in running.heartbeats} <= {"train", "step"}
    switch.touch()
    done = _ok(finish_session(proc, TIMEOUT_S, "the live run with the kill switch"))
    [stop] = events_of(run_dir, "lifecycle_stop")
    step = stop["step"]
    assert stop["reason"] == "kill_switch" and stop["exit_code"] == 0 and 1 <= step < STEPS
    assert step in _committed_steps(run_dir) and stop["last_checkpoint"] == step
    assert f"stopping at step {step}: kill switch {switch} exists; exit 0 (checkpoint: step {step})" in done.stdout
    assert {e["step"] for e in events_of(run_dir, "live_stopped")} == {step}
    assert sorted(e["rank"] for e in events_of(run_dir, "live_stopped")) == list(range(WORLD))
    again = _ok(_live(run_dir, _config(root), f"lifecycle.kill_switch_path={switch}", no_health))
    assert f"kill switch {switch} exists at start: nothing loaded or trained" in again.stdout
    assert len(events_of(run_dir, "live_start")) == WORLD  # no rank of the second run started


def test_the_time_limit_saves_and_exits_16(root):
    run_dir = root / "time_limit"
    # and lifecycle.heartbeats off: no rank writes a heartbeat file (refused in live mode before)
    done = _live(run_dir, _config(root), "lifecycle.exit_duration_in_mins=0.0001", "lifecycle.heartbeats=false")
    assert done.returncode == 16, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (run_dir / "heartbeats").exists()
    [stop] = events_of(run_dir, "lifecycle_stop")
    assert stop["reason"] == "exit_duration" and stop["exit_code"] == 16
    assert _committed_steps(run_dir) == [stop["step"]]
    assert "run again with --resume auto to continue" in done.stdout


def test_a_total_other_than_train_steps_is_one_line_from_rank_0_and_exit_2(root):
    """The loop's ``should_stop(step, total)`` with a total of 12 where the launcher runs 10: before, a
    ``ConfigError`` traceback from every rank, each one replaced as a death, until the replacements ran out."""
    run_dir, config = root / "wrong_total", _config(root)
    done = finish_session(warm_server().start(
        ["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir), "--", sys.executable,
         str(EXAMPLE), "--config", str(config), "--total", "12"], worker_env()), TIMEOUT_S, "the live run")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"trainguard: error: [rank 0] should_stop(step, total_steps=12): the live launcher runs {STEPS} "
                      "steps (config key 'train.steps'); pass the same number (guard.total_steps)"], done.stderr[-3000:]
    assert len(events_of(run_dir, "live_start")) == WORLD  # no rank replaced
    assert not events_of(run_dir, "live_exit") and not events_of(run_dir, "live_step")
