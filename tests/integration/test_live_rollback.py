"""Rollback mode (``guards.check_for_global_norm``) in live mode, on the documented user path
(``trainguard run --nproc 2 ... -- python tests/helpers/live_loop.py``: 2 replica groups x 1, dropout,
AdamW, ``optim.grad_clip`` 1.0, durable checkpoints every 3 steps, replica fingerprints before every
step, 30 steps), the loss of data position 6
multiplied by 10^4 every time it is fed (``LIVE_LOOP_SPIKE_AT``):

- step 7 (data position 6) spikes: every rank restores ``global_step_6``, the policy's window (steps 6-8,
  moved past the checkpoint: 7-8) skips data positions [6, 8), the optimizer steps go on from step 6 while
  the data positions jump to 8: the end state is, within 1e-5, that of the same training done in one
  process from the contract (``loss_of(model, position, micro_batch)``, dropout seeded from the position)
  on positions 0-5 and 8-31; the loop is told ``rolled_back`` with the restored step;
- the same run with rank 1 SIGKILLed after the rollback (step 8) ends bitwise equal: the skipped window
  travels in the join;
- the same run on 2 replica groups x 2 (rows of every parameter sharded in each group), rank 1 SIGKILLed in
  the middle of the rollback's restore (``LIVE_LOOP_DIE_IN_RESTORE``: its part of ``global_step_6`` read, its
  peers waiting in DCP's closing collective with theirs loaded): the survivors undo the spiked step, redo it
  and roll back again without the dead rank's group, the replacement rejoins, and the whole state ends
  bitwise equal to the first run's (a layout changes no bit);
- the drill's ``spike:step=7`` (a gradient spike at the optimizer step, so it recurs after the rollback)
  with ``guards.rollback.max_rollbacks: 1``: the recurrence aborts every rank with exit 3 and the
  closure mode's line, and the launcher's line names the rollback after its contract words;
- ``trainguard train`` (the reference trainer, llama-micro) live with rollback mode on 2 replica groups x 1:
  the drill's ``scale`` at step 7 (rank 0's first micro-batch, once in the run) spikes the global norm, every
  rank restores ``global_step_6`` and skips data positions [6, 8), the run ends after its 10 steps, and
  ``trainguard report``'s page lists the rollback.

The five runs start together in one module fixture (``launched``); each test waits for its own.

The rollback's restore failing (``failed_restores``, three more runs started together, the same configuration):

- rank 1's read of its part of ``global_step_6`` raises once (``LIVE_LOOP_RAISE_IN_RESTORE``; DCP raises it on
  every member): the epoch ends as after a failed collective, every member undoes the spiked step, redoes it
  and restores again; the run ends as the undisturbed one (the contract's training without the window);
- that read raises every time (``LIVE_LOOP_UNLOADABLE``): after ``fault_tolerance.max_step_failures`` (3)
  failed loads ``global_step_6`` is passed over and the rollback restores ``global_step_3``, its window moved
  past that checkpoint; the run ends as the contract's training without the window skipped;
- the reads of both checkpoints raise every time: after 3 failed loads of each, every rank ends with exit 19
  and one line naming both checkpoints and the error, both left on disk, committed and verifying.

Without the failed load ending the epoch the first and second end with exit 1 (every rank raised out of its
loop); without the checkpoint passed over the second retries the same load for ever (901 epochs in 13 minutes,
and a SIGTERM to ``trainguard run`` did not stop it: no step boundary is reached): each checked once by hand.
``CheckpointManager.roll_back`` deleting the newer checkpoints only once the restore loaded (which keeps the
third's ``global_step_6``) is checked by hand in tests/unit/live/test_live_load_failures.py.

A stop asked for while the run loops in failures (``failed_restores`` too, three more runs, each with
``fault_tolerance.max_step_failures: 1000``, SIGTERM to ``trainguard run`` once three attempts have failed, or the
kill switch's file created then):

- the rollback's restore failing every time (``LIVE_LOOP_UNLOADABLE``, never passed over): the members agree
  on the stop in the epoch after a failed one, and stop at the committed step 6 (undone to it: saved already,
  ``global_step_6``), exit 16, every checkpoint left committed and verifying;
- rank 1's loss of step 4 raising every time (``LIVE_LOOP_RAISE``): the failed step's sum carries the stop,
  every rank saves ``global_step_4`` (the committed steps) and exits 16; with the kill switch instead of SIGTERM
  (``lifecycle.kill_switch_path``, each rank's own check), the same save and exit 0 with the kill switch's line.

Without the stop taken there (the code before) both loop until the test's timeout: checked by hand.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.runs import events as events_of, finish_session, TINY, trainguard, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.config.schema import RunConfig
from trainguard.checkpoint.manifest import verify_checkpoint
from trainguard.errors import EXIT_RESUMABLE_STOP, EXIT_STEP_FAILED
from trainguard.live.compare import bitwise_differences, replica_differences, run_differences, whole_final_state
from trainguard.live.files import final_path
from trainguard.live.rng import micro_batch_rng

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import live_loop  # noqa: E402  (the rank's own model, data and spike)

EXAMPLE = ROOT / "tests" / "helpers" / "live_loop.py"
STEPS, WORLD, MICRO_BATCHES, SPIKE_AT = 30, 2, 8, 6
POSITIONS = [*range(6), *range(8, STEPS + 2)]  # the window [6, 8) skipped
TIMEOUT_S = 240


def _config(root: Path, group_size: int = 1) -> Path:
    config = root / f"live_rollback_{group_size}.yaml"
    config.write_text(f"parallel: {{dp_replicate: 2, dp_shard: {group_size}}}\n"
                      f"train: {{steps: {STEPS}, micro_batches: {MICRO_BATCHES}}}\n"
                      "fault_tolerance: {live: true, hang_s: 60}\n"
                      "checkpoint: {save_interval: 3}\n"
                      "guards: {check_for_global_norm: true, skip: {threshold: 50.0}, "
                      "rollback: {window_before: 1, window_after: 1}, fingerprint: {interval: 1}}\n")
    return config


def _live(run_dir: Path, config: Path, *sets: str, spike: bool = True, world: int = WORLD,
          **env: str) -> subprocess.CompletedProcess:
    args = [arg for item in sets for arg in ("--set", item)]
    env = worker_env(**({live_loop.SPIKE_ENV: str(SPIKE_AT)} if spike else {}), **env)
    started = warm_server().start(["run", "--nproc", str(world), "--config", str(config), "--run-dir", str(run_dir),
                                   *args, "--", sys.executable, str(EXAMPLE), "--config", str(config)], env)
    return finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}")


def _stopped_while_failing(run_dir: Path, config: Path, failures: str, switch: Path | None = None,
                           **env: str) -> subprocess.CompletedProcess:
    """The run started as ``_live``'s, looping in failures (``fault_tolerance.max_step_failures`` 1000), and
    SIGTERM to ``trainguard run`` once its rank 0 has written three ``failures`` events; with ``switch``, that
    file created instead (the run's ``lifecycle.kill_switch_path``)."""
    env = worker_env(**env)
    sets = ["--set", f"lifecycle.kill_switch_path={switch}"] if switch is not None else []
    started = warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir),
                                   "--set", "fault_tolerance.max_step_failures=1000", *sets, "--", sys.executable,
                                   str(EXAMPLE), "--config", str(config)], env)
    deadline = time.monotonic() + TIMEOUT_S
    while started.poll() is None and time.monotonic() < deadline and \
            len([e for e in events_of(run_dir, failures) if e["rank"] == 0]) < 3:
        time.sleep(0.2)
    if switch is not None:
        switch.touch()
    else:
        os.kill(started.pid, signal.SIGTERM)
    return finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}, stopped")


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def one_process_reference(positions: list[int]) -> dict[str, torch.Tensor]:
    """The contract's training in one process: each step the mean loss of its position's micro-batches
    (dropout seeded from ``(train.seed, position, micro_batch)``), clipped to 1.0, AdamW."""
    model = live_loop.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    seed = RunConfig().train.seed
    for position in positions:
        optimizer.zero_grad(set_to_none=True)
        for micro_batch in range(MICRO_BATCHES):
            with micro_batch_rng(seed, position, micro_batch):
                inputs, labels = live_loop.batch(position, micro_batch, MICRO_BATCHES)
                (F.cross_entropy(model(inputs), labels) / MICRO_BATCHES).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_rollback")


@pytest.fixture(scope="module")
def launched(root) -> dict[str, Future]:
    """Every run of the module, started at once in threads of their own (most of a run is waits they share),
    each test waiting for its own. The heartbeat timeout is long (``_config``, ``TRAINER``): 11 ranks starting
    together on a small machine can be silent for longer than the default 10 s; no run drills a hang."""
    config, sharded = _config(root), _config(root, 2)  # written here, before any thread reads them
    runs = {"rolled": lambda: _live(root / "rolled", config),
            "killed": lambda: _live(root / "killed", config, "faults=kill:rank=1,step=8"),
            "killed_in_restore": lambda: _live(root / "killed_in_restore", sharded, world=WORLD * 2,
                                               **{live_loop.DIE_IN_RESTORE_ENV: "1"}),
            "recurring": lambda: _live(root / "recurring", config, "faults=spike:step=7,factor=10000",
                                       "guards.rollback.max_rollbacks=1", spike=False),
            "trainer": lambda: finish_session(warm_server().start(["train", "--run-dir", str(root / "trainer"),
                                                                   *TRAINER], worker_env()),
                                              TIMEOUT_S, "the live trainer run with rollback")}
    warm_server()  # the session's server made here, not by several threads at once
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        yield {name: pool.submit(run) for name, run in runs.items()}


@pytest.fixture(scope="module")
def rolled(root, launched):
    return root / "rolled", _ok(launched["rolled"].result())


def test_a_spike_rolls_every_rank_back_and_the_run_equals_the_contracts_training_without_the_window(rolled):
    run_dir, _ = rolled
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["window"], event["skipped"]) == (SPIKE_AT + 1, 6, [7, 8], [[6, 8]])
    assert not events_of(run_dir, "fingerprint_mismatch")  # the replicas compared before every step agree
    for rank in range(WORLD):
        steps = [e["step"] for e in events_of(run_dir, "live_step") if e["rank"] == rank]
        assert steps == list(range(STEPS)), rank  # the spiked step 6 (from 0) is not committed, then trained again
        samples = [e["samples"] for e in events_of(run_dir, "live_samples") if e["rank"] == rank]
        assert samples[-1][0][0] // (MICRO_BATCHES * live_loop.MICRO_BATCH) == POSITIONS[-1]
    assert [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed][-3:] == [STEPS - 6, STEPS - 3, STEPS]
    reference = one_process_reference(POSITIONS)
    for rank in range(WORLD):
        model = safe_torch_load(final_path(run_dir, rank))["model"]
        assert model.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.allclose(model[name], tensor, rtol=0, atol=1e-5), (rank, name)


def test_the_loop_is_told_rolled_back_with_the_restored_step(rolled):
    _, done = rolled
    assert "rolled back to step 6" in done.stdout


def test_a_rank_killed_after_the_rollback_rejoins_with_the_window_and_the_run_ends_bitwise(root, launched, rolled):
    run_dir = root / "killed"
    done = _ok(launched["killed"].result())
    assert "ranks replaced: [1]" in done.stdout
    [joined] = events_of(run_dir, "live_joined")
    assert joined["step"] < STEPS - 5  # the replacement trains past the window with the positions it received
    assert len(events_of(run_dir, "rollback")) == 1
    assert run_differences(rolled[0], run_dir, WORLD) == {}


def test_a_rank_killed_inside_the_restore_of_a_sharded_rollback_ends_bitwise(root, launched, rolled):
    run_dir, group_size = root / "killed_in_restore", 2
    done = _ok(launched["killed_in_restore"].result())
    assert (run_dir / "died_in_restore_rank_1").exists()  # it did die inside the restore
    assert "ranks replaced: [1]" in done.stdout
    [event] = events_of(run_dir, "rollback")  # the undone restore left no rollback of its own
    assert (event["step"], event["to_step"], event["skipped"]) == (SPIKE_AT + 1, 6, [[6, 8]])
    assert replica_differences(run_dir, WORLD * group_size, group_size) == {}
    assert bitwise_differences(whole_final_state(run_dir, group_size), whole_final_state(rolled[0], 1)) == []


def test_a_rollback_that_recurs_too_often_aborts_every_rank_with_exit_3(root, launched):
    run_dir = root / "recurring"
    done = launched["recurring"].result()
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    [abort] = events_of(run_dir, "rollback_abort")
    assert "recurred after 1 rollbacks without progress (guards.rollback.max_rollbacks=1)" in abort["message"]
    assert f"trainguard: error: [rank 0] {abort['message']}" in done.stderr
    # the launcher's contract line, the rollback's reason added after it
    assert (f"trainguard: live run aborted by the data-skip guard: exit 3 ({abort['message']}); "
            f"the newest checkpoint is {run_dir / 'checkpoints' / 'global_step_6'}") in done.stdout
    assert len(events_of(run_dir, "rollback")) == 1


TRAINER_STEPS = 10
TRAINER = ["--nproc", str(WORLD), "--steps", str(TRAINER_STEPS), "--save-interval", "3", *TINY,
           *[arg for item in ("fault_tolerance.live=true", "fault_tolerance.hang_s=60", "parallel.dp_replicate=2", "train.micro_batches=2",
                              "guards.check_for_global_norm=true", "guards.skip.threshold=10.0",
                              "guards.rollback.window_before=1", "guards.rollback.window_after=1",
                              "faults=scale:rank=0,step=7,site=model.layers.0,where=grad_input,factor=1000")
             for arg in ("--set", item)]]


def test_trainguard_train_live_rolls_back_on_a_spike_skips_the_window_and_the_report_shows_it(root, launched):
    run_dir = root / "trainer"
    _ok(launched["trainer"].result())
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["window"], event["skipped"]) == (7, 6, [7, 8], [[6, 8]])
    for rank in range(WORLD):
        assert [e["step"] for e in events_of(run_dir, "live_step") if e["rank"] == rank] == list(range(TRAINER_STEPS))
    # the steps after the restore draw the data positions past the window: step 6 (from 0) trains position 8
    first_sample = {e["step"]: e["samples"][0][0] for e in events_of(run_dir, "live_samples") if e["rank"] == 0}
    assert first_sample[6] == 8 * 2 * 2 and first_sample[TRAINER_STEPS - 1] == (TRAINER_STEPS + 1) * 2 * 2
    assert [info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed][-2:] == [9, 10]
    _ok(trainguard("report", str(run_dir)))
    page = (run_dir / "report.html").read_text()
    assert re.search(r"<td>rollback</td>\s*<td>7</td>", page), page[-3000:]


@pytest.fixture(scope="module")
def failed_restores(root) -> dict[str, Future]:
    """The runs whose rollback's restore fails (the module's docstring), started at once, each test waiting for its
    own."""
    config = _config(root)
    runs = {"raised": {live_loop.RAISE_IN_RESTORE_ENV: "1"}, "walked_back": {live_loop.UNLOADABLE_ENV: "1:6"},
            "none_left": {live_loop.UNLOADABLE_ENV: "1:3,6"}}
    raising_step = {live_loop.RAISE_ENV: json.dumps([{"step": 4, "rank": 1}])}
    stopped = {"stopped_in_restores": ("live_collective_failed", None, {live_loop.SPIKE_ENV: str(SPIKE_AT),
                                                                        live_loop.UNLOADABLE_ENV: "1:6"}),
               "stopped_in_steps": ("live_step_failed", None, raising_step),
               "switched_in_steps": ("live_step_failed", root / "switch_in_steps", raising_step)}
    warm_server()
    with ThreadPoolExecutor(max_workers=len(runs) + len(stopped)) as pool:
        futures = {name: pool.submit(_live, root / name, config, **env) for name, env in runs.items()}
        futures |= {name: pool.submit(_stopped_while_failing, root / name, config, failures, switch, **env)
                    for name, (failures, switch, env) in stopped.items()}
        yield futures


def _ends_as_the_contracts_training_without(run_dir: Path, skipped: list[list[int]]) -> None:
    positions = [p for p in range(STEPS + 10) if not any(a <= p < b for a, b in skipped)][:STEPS]
    reference = one_process_reference(positions)
    for rank in range(WORLD):
        model = safe_torch_load(final_path(run_dir, rank))["model"]
        for name, tensor in reference.items():
            assert torch.allclose(model[name], tensor, rtol=0, atol=1e-5), (rank, name)


def test_a_load_that_raises_once_in_the_rollbacks_restore_ends_the_epoch_and_the_rollback_restores_again(
        root, failed_restores):
    run_dir = root / "raised"
    done = _ok(failed_restores["raised"].result())
    assert (run_dir / "died_in_restore_rank_1").exists()  # its read did raise inside the restore
    [failed] = [e for e in events_of(run_dir, "live_collective_failed") if e["rank"] == 0]
    assert failed["error"].startswith("RuntimeError: live recovery: the restore for a rollback before step 7 "
                                      "failed: cannot load ")
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["skipped"]) == (SPIKE_AT + 1, 6, [[6, 8]])
    assert "rolled back to step 6" in done.stdout
    _ends_as_the_contracts_training_without(run_dir, event["skipped"])


def test_a_checkpoint_whose_load_always_raises_is_passed_over_and_the_rollback_walks_back(root, failed_restores):
    run_dir = root / "walked_back"
    done = _ok(failed_restores["walked_back"].result())
    assert len([e for e in events_of(run_dir, "live_collective_failed") if e["rank"] == 0]) == 3
    [passed] = events_of(run_dir, "live_restore_passed_over")
    assert (passed["checkpoint"], passed["failures"]) == (6, 3)
    assert "injected: rank 1's read of its part of global_step_6 failed" in passed["error"]
    assert "live recovery: global_step_6 failed to load 3 times (fault_tolerance.max_step_failures): cannot load " \
           in done.stdout + done.stderr
    assert "; passed over for an older checkpoint from now on" in done.stdout + done.stderr
    [event] = events_of(run_dir, "rollback")
    assert (event["step"], event["to_step"], event["attempt"]) == (SPIKE_AT + 1, 3, 1)
    assert "rolled back to step 3" in done.stdout
    _ends_as_the_contracts_training_without(run_dir, event["skipped"])


def test_with_no_checkpoint_that_loads_every_rank_ends_with_exit_19_naming_them_and_both_are_kept(
        root, failed_restores):
    run_dir = root / "none_left"
    done = failed_restores["none_left"].result()
    assert done.returncode == EXIT_STEP_FAILED, done.stdout[-3000:] + done.stderr[-3000:]
    assert [e["checkpoint"] for e in events_of(run_dir, "live_restore_passed_over")] == [6, 3]
    line = next(line for line in done.stderr.splitlines() if line.startswith("trainguard: error: [rank 0] "))
    assert "the restore before step 7 found no checkpoint that loads: global_step_6 (3 failed loads, the last: " \
           "cannot load " in line
    assert "; global_step_3 (3 failed loads, the last: cannot load " in line
    assert "injected: rank 1's read of its part of global_step_3 failed" in line
    assert line.endswith("; every checkpoint is left as it was")
    checkpoints = run_dir / "checkpoints"
    assert (f"trainguard: live run ended: the restore before step 7 found no checkpoint that loads (each failed "
            f"fault_tolerance.max_step_failures times): exit 19; the newest checkpoint is "
            f"{checkpoints / 'global_step_6'}") in done.stdout  # not "a step failed ...": no step's loss raised
    committed = [info for info in list_checkpoints(checkpoints) if info.committed]
    assert [info.step for info in committed] == [3, 6]
    assert all(verify_checkpoint(info.path, info.manifest) == [] for info in committed)
    assert not events_of(run_dir, "rollback")


def _stopped_at(run_dir: Path, done: subprocess.CompletedProcess, step: int, switch: Path | None = None) -> None:
    """The quorum's SIGTERM stop at ``step`` (the committed steps), saved there: exit 16, the closure mode's
    ``lifecycle_stop`` and the launcher's line; with ``switch``, the kill switch's stop (exit 0, its line);
    every checkpoint committed and verifying, none past ``step``."""
    code, reason = (EXIT_RESUMABLE_STOP, "signal") if switch is None else (0, "kill_switch")
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    [stop] = events_of(run_dir, "lifecycle_stop")
    assert (stop["step"], stop["reason"], stop["exit_code"], stop["last_checkpoint"]) == (step, reason, code, step)
    assert sorted((e["rank"], e["step"]) for e in events_of(run_dir, "live_stopped")) == [(0, step), (1, step)]
    if switch is None:
        assert f"live run stopped by SIGTERM/SIGUSR1: saved {run_dir / 'checkpoints' / f'global_step_{step}'}" \
            in done.stdout
    else:
        assert f"stopping at step {step}: kill switch {switch} exists; exit 0 (checkpoint: step {step})" in done.stdout
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert [info.step for info in checkpoints if info.committed][-1] == step
    assert all(verify_checkpoint(info.path, info.manifest) == [] for info in checkpoints)
    assert max(e["step"] for e in events_of(run_dir, "live_step")) == step - 1


def test_sigterm_while_the_rollbacks_restore_keeps_failing_stops_at_the_committed_step(root, failed_restores):
    run_dir = root / "stopped_in_restores"
    done = failed_restores["stopped_in_restores"].result()
    assert len([e for e in events_of(run_dir, "live_collective_failed") if e["rank"] == 0]) >= 3
    assert not events_of(run_dir, "live_restore_passed_over")
    _stopped_at(run_dir, done, SPIKE_AT)  # undone to before the spiked step: global_step_6, saved already


def test_sigterm_while_a_step_keeps_failing_saves_the_committed_steps_and_stops(root, failed_restores):
    run_dir = root / "stopped_in_steps"
    done = failed_restores["stopped_in_steps"].result()
    assert len([e for e in events_of(run_dir, "live_step_failed") if e["rank"] == 0]) >= 3
    _stopped_at(run_dir, done, 4)


def test_the_kill_switch_while_a_step_keeps_failing_saves_the_committed_steps_and_stops_with_exit_0(
        root, failed_restores):
    run_dir = root / "switched_in_steps"
    done = failed_restores["switched_in_steps"].result()
    assert len([e for e in events_of(run_dir, "live_step_failed") if e["rank"] == 0]) >= 3
    _stopped_at(run_dir, done, 4, switch=root / "switch_in_steps")
