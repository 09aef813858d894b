"""The reference trainer in live mode: ``trainguard train --set fault_tolerance.live=true`` on 4 gloo
ranks (2 replica groups x 2, llama-micro), once as a user runs it, once with rank 3 SIGKILLed after
step 3 (the run the command builds with ``--set faults=kill:rank=3,step=3``, ``cli.train_live.live_run``;
a cold replacement rejoins, at the latest at the last step, where the survivors wait for it). The survivors keep their processes and every rank ends with the
fault-free run's parameters and optimizer state, bit for bit, its LR the schedule's for the last step."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from helpers.runs import trainguard
from helpers.sharded_state import assert_each_rank_holds_its_share
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.cli import build_parser
from trainguard.cli.train_live import live_run
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path, final_path
from trainguard.live.launcher import launch
from trainguard.live.samples import sample_problems
from trainguard.trainer.entry import config_from_args
from trainguard.trainer.optim import lr_factor

ROOT = Path(__file__).resolve().parents[2]
STEPS, WORLD, GROUP, KILLED, MICRO_BATCHES, MICRO_BATCH_SIZE = 8, 4, 2, 3, 4, 2
OVERRIDES = ["fault_tolerance.live=true", "parallel.dp_replicate=2",
             "model.preset=llama-micro", "data.seq_len=32", f"train.micro_batches={MICRO_BATCHES}",
             f"data.micro_batch_size={MICRO_BATCH_SIZE}"]


def train_argv(run_dir: Path) -> list[str]:
    return ["train", "--nproc", str(WORLD), "--run-dir", str(run_dir), "--steps", str(STEPS),
            *[arg for item in OVERRIDES for arg in ("--set", item)]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_trainer")
    clean = trainguard(*train_argv(root / "clean"), timeout=300)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    argv = [*train_argv(root / "failed"), "--set", f"faults=kill:rank={KILLED},step=3"]  # the live drill's key
    args = build_parser(argv).parse_args(argv)
    run = live_run(args, config_from_args(args), "--set")
    assert (run.kill_ranks, run.kill_at_step) == ((KILLED,), 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT / "src"))  # the ranks import this checkout (started cold)
        result = launch(root / "failed", run)
    return root, clean.stdout, result


def test_the_command_trains_every_step_on_every_rank(runs):
    root, stdout, _ = runs
    assert f"live run finished: {STEPS} steps" in stdout and "ranks replaced: none" in stdout
    assert replica_differences(root / "clean", WORLD, GROUP) == {}  # the replicas of each shard agree


def test_the_quorums_first_member_writes_the_reference_step_line_with_tokens_per_second(runs):
    """``train.log_interval`` (1) in live mode: one line per step, by one rank only, the closure mode's, with
    ``tokens/s`` from the trainer's ``Guard(tokens_per_step=...)``: the global batch over the step's time, the
    figure each ``live_step`` event carries too."""
    root, stdout, _ = runs
    tokens_per_step = MICRO_BATCHES * MICRO_BATCH_SIZE * 32  # data.seq_len
    events = [e for e in read_events(events_path(root / "clean")) if e["kind"] == "live_step"]
    assert all(e["tokens_per_s"] == pytest.approx(tokens_per_step / e["step_time"]) for e in events)
    for step in range(1, STEPS + 1):
        lines = [line for line in stdout.splitlines() if f"step: [{step:5d}/{STEPS:5d}], loss: " in line]
        assert len(lines) == 1 and ", tokens/s: " in lines[0], (step, lines)


def test_the_lr_follows_the_trainers_schedule(runs):
    root, _, _ = runs
    config = config_from_args(build_parser(train_argv(root)).parse_args(train_argv(root)))
    final = safe_torch_load(final_path(root / "clean", 0))
    # the scheduler steps after each update, as the closure mode's: the optimizer is left with the LR of the
    # step after the last, the schedule's after STEPS updates
    expected = config.optim.lr * lr_factor(STEPS, config.optim.warmup_steps, STEPS, config.optim.min_lr_ratio)
    assert {group["lr"] for group in final["optimizer"]["param_groups"]} == {expected} and expected != config.optim.lr
    assert final["scheduler"]["last_epoch"] == STEPS


def test_survivors_keep_their_processes_and_end_bitwise_equal_to_the_fault_free_run(runs):
    root, _, result = runs
    assert all(result.first_pids[r] == result.last_pids[r] for r in range(WORLD) if r != KILLED)
    assert result.first_pids[KILLED] != result.last_pids[KILLED]
    events = list(read_events(events_path(root / "failed")))
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    pids = defaultdict(set)
    for event in events:
        if event["kind"] == "live_start":
            pids[event["rank"]].add(event["pid"])
    assert all(len(pids[r]) == 1 for r in range(WORLD) if r != KILLED)
    assert run_differences(root / "clean", root / "failed", WORLD) == {}
    assert replica_differences(root / "failed", WORLD, GROUP) == {}


def test_no_sample_lost_or_repeated(runs):
    root, _, _ = runs
    for name in ("clean", "failed"):
        events = list(read_events(events_path(root / name)))
        assert sample_problems(events, STEPS, MICRO_BATCHES * MICRO_BATCH_SIZE) == [], name


def test_each_rank_holds_half_of_its_groups_parameters(runs):
    """``dp_shard`` 2: from the local shard sizes of every rank's final state (the replacement's too),
    each rank holds exactly half of the llama's parameters, its ``torch.chunk`` rows of each, and the
    optimizer state of those rows only."""
    root, _, _ = runs
    for run in ("clean", "failed"):
        assert_each_rank_holds_its_share(root / run, WORLD, GROUP)
