"""examples/hf_trainer.py (``GuardedTrainer``, the Hugging Face ``Trainer`` adapter, on a tiny Qwen2 from a
config) trained with live recovery by configuration alone: ``trainguard run --nproc 2 --config Y -- python
examples/hf_trainer.py --config Y`` where Y says ``fault_tolerance.live: true``, 2 replica groups of 1
rank, 8 steps of 4 micro-batches of 2 samples, a durable checkpoint every 4 steps. Run once without a
fault and once with rank 1 SIGKILLed by the drill after step 3 and one warm spare: the survivor keeps its
process, the spare takes rank 1's place with a live peer's state, the final state of every rank and the
final durable checkpoint are bitwise the fault-free run's, and rank 0's Trainer logs each step once, the
same in both runs, with the live step's loss and global norm, the plain ``Trainer``'s schedule and epoch;
every rank's ``TrainerState`` rides in the checkpoints and to the spare. Once more with rank 0, the
logging rank, killed instead: its replacement logs on. A third run is stopped by SIGTERM
to ``trainguard run`` (exit 16, saved at the stop) and run again with ``--resume auto``: it ends bitwise
the fault-free run, and rank 0 logs the steps after the resume as the fault-free run did. The whole job
SIGKILLed (launcher and ranks) once step 4's save committed, then ``--resume auto``: bitwise the fault-free
run too. The kill switch and the time limit (``lifecycle.*``) stop it at a saved step, exit 0 and 16."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from helpers.runs import assert_same_tensors, events as events_of, finish_session, trainguard, worker_env
from helpers.warm_command import warm_server

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

from transformers import get_cosine_schedule_with_warmup  # noqa: E402

from trainguard.checkpoint.discovery import list_checkpoints  # noqa: E402
from trainguard.checkpoint.safe_load import safe_torch_load  # noqa: E402
from trainguard.fs.layout import extra_state_name  # noqa: E402
from trainguard.live.compare import bitwise_differences  # noqa: E402
from trainguard.live.files import events_path, final_path  # noqa: E402
from trainguard.live.samples import sample_problems  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
STEPS, WORLD, KILLED, KILL_AT = 8, 2, 1, 3
MICRO_BATCHES, BATCH, DATASET = 4, 2, 256  # the example's per_device_train_batch_size and data set size
# the heartbeat timeout long: the module's first five jobs start together, and their ranks and spares on a small
# machine can be silent for longer than the default 10 s (no run drills a hang; a killed rank is seen by its exit)
LIVE = {"fault_tolerance": {"live": True, "hang_s": 60}, "parallel": {"dp_replicate": WORLD},
        "train": {"steps": STEPS, "micro_batches": MICRO_BATCHES}, "checkpoint": {"save_interval": 4}}


def _run_args(config: Path, run_dir: Path, log_file: str, *extra: str) -> list[str]:
    return ["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir), *extra, "--",
            sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--config", str(config),
            "--log-file", str(run_dir / log_file)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live_hf_trainer")
    (root / "live.yaml").write_text(yaml.safe_dump(LIVE), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def resumed_jobs(root) -> dict[str, Future]:
    """The stopped job and the SIGKILLed one, each with its resume, in threads of their own: started with the
    module's first runs (``runs`` asks for them first), waited for by the tests that read them."""
    warm_server()  # the session's server made here, not by two threads at once
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"stopped": pool.submit(_stopped_and_resumed, root), "sigkilled": pool.submit(_sigkilled_and_resumed, root)}


@pytest.fixture(scope="module")
def runs(root, resumed_jobs) -> Path:
    config = root / "live.yaml"
    spare = "fault_tolerance.spares=1"
    started = {}
    for name, overrides in (("clean", ()), ("failed", (spare, f"faults=kill:rank={KILLED},step={KILL_AT}")),
                            ("rank_0_killed", (spare, f"faults=kill:rank=0,step={KILL_AT}"))):
        sets = [arg for item in overrides for arg in ("--set", item)]
        started[name] = warm_server().start(_run_args(config, root / name, "logs.jsonl", *sets), worker_env())
    for name, proc in started.items():  # started together: most of a run is waits they share
        done = finish_session(proc, 300, f"the live run {name}")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"live run finished: {STEPS} steps" in done.stdout
    return root


def _stopped_and_resumed(root: Path) -> tuple[Path, int, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """SIGTERM to ``trainguard run`` once a rank committed its first step (of 8: the stop lands some steps
    later, at the boundary the quorum agrees on; seen: after step 5), then the same command with ``--resume
    auto``: the run dir, the step saved at the stop, the stopped and the resumed command."""
    run_dir, config = root / "stopped", root / "live.yaml"
    proc = warm_server().start(_run_args(config, run_dir, "logs.jsonl"), worker_env())
    deadline = time.monotonic() + 300
    while not (events_path(run_dir).exists() and any(e["kind"] == "live_step" for e in events_of(run_dir))):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 1"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    stop = finish_session(proc, 300, "the stopped live run")
    assert stop.returncode == 16, stop.stdout[-3000:] + stop.stderr[-3000:]
    saved = max(info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed)
    again = trainguard(*_run_args(config, run_dir, "resumed_logs.jsonl", "--resume", "auto"), timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return run_dir, saved, stop, again


@pytest.fixture(scope="module")
def stopped(resumed_jobs) -> tuple[Path, int, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return resumed_jobs["stopped"].result()


def _start_and_wait(run_dir: Path, condition, what: str, *sets: str):
    """``trainguard run`` of the example started (``--set`` items ``sets``), once ``condition()`` holds."""
    args = [arg for item in sets for arg in ("--set", item)]
    proc = warm_server().start(_run_args(_config_of(run_dir), run_dir, "logs.jsonl", *args), worker_env())
    deadline = time.monotonic() + 300
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before {what}"
        time.sleep(0.02)
    return proc


def _config_of(run_dir: Path) -> Path:
    return run_dir.parent / "live.yaml"


def _first_step_done(run_dir: Path) -> bool:
    return events_path(run_dir).exists() and any(e["kind"] == "live_step" for e in events_of(run_dir))


def _sigkilled_and_resumed(root: Path) -> tuple[Path, int, subprocess.CompletedProcess]:
    """The whole job (launcher and ranks) SIGKILLed once the durable save of step 4 committed, then the
    same command with ``--resume auto``: the run dir, the step it resumed from, the resumed command."""
    run_dir = root / "sigkilled"

    def committed() -> list[int]:
        return [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed]

    proc = _start_and_wait(run_dir, lambda: (run_dir / "checkpoints").is_dir() and 4 in committed(),
                           "the save of step 4 committed")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    ranks = [e["pid"] for e in events_of(run_dir) if e["kind"] == "live_start"]
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(final_path(run_dir, rank).exists() for rank in range(WORLD)), "the run ended before the kill"
    newest = max(committed())
    again = trainguard(*_run_args(_config_of(run_dir), run_dir, "resumed_logs.jsonl", "--resume", "auto"),
                       timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return run_dir, newest, again


@pytest.fixture(scope="module")
def sigkilled(resumed_jobs) -> tuple[Path, int, subprocess.CompletedProcess]:
    return resumed_jobs["sigkilled"].result()


def _final_state(run_dir: Path, rank: int) -> tuple[dict, dict]:
    """A rank's final state file: the engine's state, and the Trainer's state it holds (parsed)."""
    state = safe_torch_load(final_path(run_dir, rank))
    return state, json.loads(state["stateful"].pop("trainer_state")["json"])


def _final_differences(reference: Path, run: Path) -> dict[int, list[str]]:
    """``live.compare.run_differences`` with the Trainer's state compared as JSON, less its log history
    (``_final_logs``)."""
    found = {}
    for rank in range(WORLD):
        (state, trainer_state), (other, other_trainer_state) = _final_state(reference, rank), _final_state(run, rank)
        del trainer_state["log_history"], other_trainer_state["log_history"]
        found[rank] = (bitwise_differences(state, other)
                       + bitwise_differences(trainer_state, other_trainer_state, "/trainer_state"))
    return {rank: where for rank, where in found.items() if where}


def _final_logs(run_dir: Path, rank: int) -> list[dict]:
    """A rank's log history at the end, less the summary ``train()`` logs last (its runtime, and
    ``train_loss`` over the steps this process trained: a replacement's or a resumed run's are its own)."""
    log_history = _final_state(run_dir, rank)[1]["log_history"]
    summary = log_history.pop()
    assert "train_runtime" in summary and "loss" not in summary, summary
    return log_history


def _checkpointed_trainer_state(checkpoint: Path, rank: int) -> dict:
    extra_state = safe_torch_load(checkpoint / extra_state_name(WORLD, rank))
    return json.loads(extra_state["stateful"]["trainer_state"]["json"])


def _logged_steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs.jsonl").read_text(encoding="utf-8").splitlines()
    return [entry for entry in map(json.loads, lines) if "loss" in entry]


def _joiners_logs(logged: list[dict], joined_step: int) -> list[dict]:
    """What a rank that joined at ``joined_step`` logs of ``logged`` (the fault-free run's): not that step,
    whose entry its state was taken before, and its first entry after it naming it (``joined_after_step``)."""
    entries = [dict(entry) for entry in logged if entry["step"] != joined_step]
    for entry in entries:
        if entry["step"] > joined_step:
            entry["joined_after_step"] = joined_step
            break
    return entries


def test_the_survivor_keeps_its_pid_and_the_spare_rejoins_in_rank_1s_place(runs):
    events = events_of(runs / "failed")
    pids = defaultdict(list)
    for event in events:
        if event["kind"] == "live_start":
            pids[event["rank"]].append((event["pid"], event["rejoin"]))
    assert len(pids[0]) == 1 and [rejoin for _, rejoin in pids[KILLED]] == [False, True], dict(pids)
    kill = next(e for e in events if e["kind"] == "live_kill")
    assert (kill["pid"], kill["target"], kill["step"]) == (pids[KILLED][0][0], KILLED, KILL_AT)
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1], [0], [0, 1]]
    (joined,) = [e for e in events if e["kind"] == "live_joined"]
    assert joined["rank"] == KILLED and joined["state_bytes"] > 0 and KILL_AT < joined["step"] <= STEPS
    alone = [e for e in events if e["kind"] == "live_step" and e["members"] == 1]
    assert alone and all(e["rank"] == 0 and len(e["micro_batches"]) == MICRO_BATCHES for e in alone)


def test_final_state_and_durable_checkpoint_equal_the_fault_free_run_bitwise(runs):
    assert _final_differences(runs / "clean", runs / "failed") == {}
    final = Path("checkpoints") / f"global_step_{STEPS}"
    assert assert_same_tensors(runs / "clean" / final, runs / "failed" / final) > 0
    config = json.loads((runs / "failed" / final / "huggingface" / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "qwen2"  # the Trainer's model.config, for trainguard ckpt merge


def test_every_step_takes_the_trainers_samples_once(runs):
    for name in ("clean", "failed"):
        assert sample_problems(events_of(runs / name), STEPS, MICRO_BATCHES * BATCH) == [], name


def test_rank_0_logs_each_step_once_as_the_plain_trainer_would(runs):
    """``loss``: the step's mean over its global batch (the live step's, as the Trainer's float32 sum holds
    it); ``grad_norm``: the live step's global norm before clipping; ``learning_rate``: the plain Trainer's
    cosine schedule for that step; ``epoch``: samples consumed over the data set's size."""
    clean, failed = _logged_steps(runs / "clean"), _logged_steps(runs / "failed")
    assert [entry["step"] for entry in clean] == list(range(1, STEPS + 1))
    assert failed == clean
    committed = {e["step"]: e for e in events_of(runs / "clean") if e["kind"] == "live_step" and e["rank"] == 0}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)  # the example's rate and schedule
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=STEPS)
    for entry in clean:
        step = committed[entry["step"] - 1]
        assert entry["loss"] == torch.tensor(step["loss"], dtype=torch.float32).item()
        assert entry["grad_norm"] == step["global_norm"]
        assert entry["learning_rate"] == schedule.get_last_lr()[0]
        assert entry["epoch"] == entry["step"] * MICRO_BATCHES * BATCH / DATASET
        optimizer.step()
        schedule.step()


def test_the_trainer_state_rides_in_durable_checkpoints_and_to_the_replacement(runs):
    """The Trainer counts, logs and calls back after ``training_step`` returns, and every live rank logs the
    same values, so each rank holds the same log. A checkpoint or a joiner's state is taken inside a step,
    before the Trainer logs it: ``global_step_8`` holds the log of steps 1 to 7, and the spare, which
    joined at a step boundary with rank 0's state, lacks the log entry of the step it joined after, and its
    first entry after the join names that step."""
    (joined,) = [e for e in events_of(runs / "failed") if e["kind"] == "live_joined"]
    logged = _logged_steps(runs / "clean")
    joiners = _joiners_logs(logged, joined["step"])
    for name in ("clean", "failed"):
        for rank in range(WORLD):
            replaced = name == "failed" and rank == KILLED
            expected = joiners if replaced else logged
            assert _final_logs(runs / name, rank) == expected, (name, rank)
            state = _checkpointed_trainer_state(runs / name / "checkpoints" / f"global_step_{STEPS}", rank)
            assert (state["global_step"], state["log_history"]) == (STEPS - 1, expected[:-1]), (name, rank)
            assert state["is_world_process_zero"] == (rank == 0), (name, rank)


def test_sigterm_to_the_run_saves_exits_16_and_resume_auto_ends_bitwise_with_the_same_logs(runs, stopped):
    run_dir, saved, stop, again = stopped
    assert 1 <= saved < STEPS, saved
    assert f"live run stopped by SIGTERM/SIGUSR1: saved {run_dir / 'checkpoints' / f'global_step_{saved}'}" in stop.stdout
    assert f"live run resumes from {run_dir / 'checkpoints' / f'global_step_{saved}'}" in again.stdout
    assert _final_differences(runs / "clean", run_dir) == {}
    final = Path("checkpoints") / f"global_step_{STEPS}"
    assert assert_same_tensors(runs / "clean" / final, run_dir / final) > 0
    clean = _logged_steps(runs / "clean")
    resumed = [json.loads(line) for line in (run_dir / "resumed_logs.jsonl").read_text(encoding="utf-8").splitlines()]
    resumed = [entry for entry in resumed if "loss" in entry]
    assert _logged_steps(run_dir) == clean[:saved]  # before the stop: steps 1 .. saved
    assert resumed == clean[saved:]  # loss, grad_norm, learning_rate, epoch of steps saved+1 .. STEPS
    # the Trainer's state came back with the checkpoint, saved inside step `saved` before the Trainer logged
    # it: its log history goes on from there, that step's entry lacking (as in the closure mode)
    assert _final_logs(run_dir, 0) == [entry for entry in clean if entry["step"] != saved]


def test_a_replacement_of_rank_0_logs_on_from_the_step_after_it_joined(runs):
    """Rank 0, the logging rank, SIGKILLed after step 3: the spare takes its place with rank 1's state (the
    lowest live rank's), is then the Trainer's world process zero and logs every step after the one it
    joined after, as the fault-free run logged it; the steps rank 1 trained alone are not logged, and its
    first log line names the step it joined after (``joined_after_step``)."""
    run_dir = runs / "rank_0_killed"
    (joined,) = [e for e in events_of(run_dir) if e["kind"] == "live_joined"]
    assert joined["rank"] == 0 and KILL_AT < joined["step"] < STEPS
    assert _final_differences(runs / "clean", run_dir) == {}
    clean = _logged_steps(runs / "clean")
    logged = _logged_steps(run_dir)
    first_after_join = next(entry for entry in logged if entry["step"] > joined["step"])
    assert first_after_join.pop("joined_after_step") == joined["step"]
    assert not [entry for entry in logged if "joined_after_step" in entry]  # that line only
    clean_by_step = {entry["step"]: entry for entry in clean}
    assert all(entry == clean_by_step[entry["step"]] for entry in logged)
    steps = [entry["step"] for entry in logged]
    assert steps == sorted(set(steps))  # each step once
    # the first rank 0's steps (the kill can land before it logged step 3), then the replacement's
    assert set(range(1, KILL_AT)) | set(range(joined["step"] + 1, STEPS + 1)) <= set(steps)
    assert joined["step"] not in steps
    assert _final_logs(run_dir, 0) == _joiners_logs(clean, joined["step"])


def test_the_whole_job_sigkilled_resumes_auto_and_ends_bitwise_the_fault_free_run(runs, sigkilled):
    """As the closure mode's GuardedTrainer under the supervisor: SIGKILL to every process of the job (no
    save at the kill), then ``--resume auto`` from the newest durable checkpoint: every rank's final state,
    the Trainer's included, and the final durable checkpoint are bitwise the fault-free run's."""
    run_dir, newest, again = sigkilled
    assert 4 <= newest < STEPS
    assert f"live run resumes from {run_dir / 'checkpoints' / f'global_step_{newest}'}" in again.stdout
    assert _final_differences(runs / "clean", run_dir) == {}
    final = Path("checkpoints") / f"global_step_{STEPS}"
    assert assert_same_tensors(runs / "clean" / final, run_dir / final) > 0


def test_the_kill_switch_stops_the_trainer_at_a_saved_step_with_exit_0(runs):
    """``lifecycle.kill_switch_path`` created once a step committed: the quorum stops at its next boundary,
    saved, and every rank's ``train()`` ends the process with exit 0 and the closure mode's line."""
    run_dir, switch = runs / "switched", runs / "switch"
    proc = _start_and_wait(run_dir, lambda: _first_step_done(run_dir), "its first step",
                           f"lifecycle.kill_switch_path={switch}")
    switch.touch()
    done = finish_session(proc, 300, "the live run with the kill switch")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stops = [e for e in events_of(run_dir) if e["kind"] == "lifecycle_stop"]
    assert {(e["reason"], e["exit_code"]) for e in stops} == {("kill_switch", 0)}
    step = stops[0]["step"]
    assert 1 <= step < STEPS and step in [info.step for info in list_checkpoints(run_dir / "checkpoints")
                                          if info.committed]
    assert f"stopping at step {step}: kill switch {switch} exists; exit 0 (checkpoint: step {step})" in done.stdout


def test_the_time_limit_stops_the_trainer_at_a_saved_step_with_exit_16(runs):
    """``lifecycle.exit_duration_in_mins`` too short for one more step: saved at the first boundary, exit 16."""
    run_dir = runs / "time_limit"
    args = ["--set", "lifecycle.exit_duration_in_mins=0.0001"]
    done = trainguard(*_run_args(_config_of(run_dir), run_dir, "logs.jsonl", *args), timeout=300)
    assert done.returncode == 16, done.stdout[-3000:] + done.stderr[-3000:]
    [step] = {e["step"] for e in events_of(run_dir) if e["kind"] == "lifecycle_stop" and e["reason"] == "exit_duration"}
    assert [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed] == [step]
    assert "run again with --resume auto to continue" in done.stdout


def test_a_max_steps_other_than_train_steps_is_one_line_naming_both_and_exit_2(runs):
    """The Trainer's ``TrainingArguments(max_steps=12)`` where the live launcher runs ``train.steps`` = 8:
    one line from rank 0 naming both, every rank exits 2 and none is replaced."""
    run_dir = runs / "wrong_max_steps"
    done = trainguard("run", "--nproc", str(WORLD), "--config", str(_config_of(run_dir)), "--run-dir", str(run_dir),
                      "--", sys.executable, str(ROOT / "tests" / "helpers" / "hf_trainer_max_steps.py"),
                      "--max-steps", "12", "--config", str(_config_of(run_dir)), timeout=300)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"trainguard: error: [rank 0] GuardedTrainer: TrainingArguments(max_steps=12): the live launcher "
                      f"runs {STEPS} steps (config key 'train.steps'); pass the same number (guard.total_steps)"], errors
    assert len([e for e in events_of(run_dir) if e["kind"] == "live_start"]) == WORLD  # no rank replaced
