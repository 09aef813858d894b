"""examples/user_loop.py, the loop that tests/integration/test_user_loop_faults.py runs under ``torchrun``
(``guard.resume()``, ``guard.should_stop(step, total)``, ``guard.step(loss_of)``, ``guard.close()``),
trained with live recovery by configuration alone: ``trainguard run --nproc 4 --config Y -- python
examples/user_loop.py`` where Y is examples/user_loop.yaml with ``fault_tolerance.live: true`` and the
live layout (2 replica groups x 2) added, with every key of it on: data skip, checkpoint health, SDC level 2 with 2 strikes, clipping, the
durable tier and the local tier (every 2 steps: each rank's own copy). Run once
without a fault and once with the drill's SIGKILL of rank 3 at step 5 and two warm spares, the first
made to fail its self-test. The survivors keep their processes, the replaced group rejoins with a live
peer's state, every rank ends with the fault-free run's parameters and optimizer state bit for bit, and
so does the final durable checkpoint, which holds the loop's ``hf_config`` as under torchrun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from helpers.runs import assert_same_tensors, events as events_of, trainguard
from trainguard.live.compare import replica_differences, run_differences, whole_final_state

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE, CONFIG = ROOT / "examples" / "user_loop.py", ROOT / "examples" / "user_loop.yaml"
STEPS, WORLD, GROUP, KILLED, KILL_AT = 12, 4, 2, 3, 5
LIVE = {"fault_tolerance": {"live": True}, "parallel": {"dp_replicate": 2, "dp_shard": GROUP}}


def live_config(path: Path) -> Path:
    """examples/user_loop.yaml with live recovery on (``LIVE``)."""
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    path.write_text(yaml.safe_dump({**config, **LIVE}), encoding="utf-8")
    return path


def _run(config: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [arg for item in (f"train.steps={STEPS}", *overrides) for arg in ("--set", item)]
    return trainguard("run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir), *sets, "--",
                      sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--config", str(config), timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_user_loop")
    config = live_config(root / "user_loop_live.yaml")
    outputs = {}
    # two warm spares, the first made to fail its self-test (the doctor's miscompute fault): the second
    # replaces the killed rank
    for name, overrides in (("clean", ()), ("failed", (f"faults=kill:rank={KILLED},step={KILL_AT}; miscompute:rep=0,rank=0",
                                                         "fault_tolerance.spares=2"))):
        done = _run(config, root / name, *overrides)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs[name] = done.stdout
    return root, outputs


def test_the_live_configuration_is_the_loops_own_plus_the_live_keys(tmp_path):
    live = yaml.safe_load(live_config(tmp_path / "live.yaml").read_text(encoding="utf-8"))
    own = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    assert set(live) == set(own) | set(LIVE) and all(live[key] == value for key, value in LIVE.items())
    assert live["guards"]["skip"] == own["guards"]["skip"] and live["optim"] == own["optim"]
    assert live["train"] == own["train"] and live["checkpoint"]["save_interval"] == own["checkpoint"]["save_interval"]


def test_survivors_keep_their_pids_and_the_killed_rank_is_replaced(runs):
    runs, _ = runs
    pids = defaultdict(list)
    for event in events_of(runs / "failed"):
        if event["kind"] == "live_start":
            pids[event["rank"]].append(event["pid"])
    assert all(len(pids[rank]) == 1 for rank in range(WORLD) if rank != KILLED), dict(pids)
    assert len(set(pids[KILLED])) == 2, pids[KILLED]
    kill = next(e for e in events_of(runs / "failed") if e["kind"] == "live_kill")
    assert (kill["pid"], kill["target"], kill["step"]) == (pids[KILLED][0], KILLED, KILL_AT)


def test_a_spare_that_fails_its_self_test_is_passed_over_for_the_next(runs):
    runs, _ = runs
    events = events_of(runs / "failed")
    checked = {e["spare"]: e for e in events if e["kind"] == "live_spare_checked"}
    assert sorted(checked) == [0, 1] and all(e["checks"] == ["burn-in", "storage"] for e in checked.values())
    assert not checked[0]["healthy"] and "burn-in spare 0" in checked[0]["reason"]
    assert checked[1]["healthy"] and checked[1]["reason"] is None
    excluded = [e for e in events if e["kind"] == "live_spare_excluded"]
    assert [(e["spare"], e["reason"]) for e in excluded] == [(0, checked[0]["reason"])]
    replacement = [e["pid"] for e in events if e["kind"] == "live_start" and e["rank"] == KILLED][-1]
    assert replacement == checked[1]["pid"]


def test_the_broken_group_leaves_and_rejoins_with_a_peers_state(runs):
    runs, _ = runs
    events = events_of(runs / "failed")
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    joined = {e["rank"]: e for e in events if e["kind"] == "live_joined"}
    assert sorted(joined) == [2, 3] and all(e["state_bytes"] > 0 for e in joined.values())
    assert all(KILL_AT < e["step"] <= STEPS for e in joined.values())
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}  # the survivors did the group's share
    assert all(len(e["micro_batches"]) == 2 for e in degraded)  # 4 micro-batches (user_loop.yaml) over 2


def test_final_state_and_durable_checkpoint_equal_the_fault_free_run_bitwise(runs):
    runs, _ = runs
    whole = whole_final_state(runs / "clean", GROUP)
    assert {state["step"].item() for state in whole["optimizer"]["state"].values()} == {STEPS}
    assert run_differences(runs / "clean", runs / "failed", WORLD) == {}
    for name in ("clean", "failed"):
        assert replica_differences(runs / name, WORLD, GROUP) == {}, name
    final = Path("checkpoints") / f"global_step_{STEPS}"
    assert assert_same_tensors(runs / "clean" / final, runs / "failed" / final) > 0


def test_every_durable_save_records_its_health_alike_in_both_runs(runs):
    """``guards.health`` (the example's threshold on the GPT-2 input embedding): a record in
    ``health_ckpts.json`` for each committed checkpoint, the same verdicts and norms in both runs."""
    runs, _ = runs
    records = {}
    for name in ("clean", "failed"):
        root = runs / name / "checkpoints"
        committed = sorted(root.glob("global_step_*"))
        named = {r["ckpt_name"]: r["is_health"] for r in json.loads((root / "health_ckpts.json").read_text())}
        assert committed and sorted(named) == sorted(path.name for path in committed), name
        records[name] = {path.name: json.loads((path / "trainguard.json").read_text())["health"]
                         for path in committed}
    final = f"global_step_{STEPS}"
    assert records["failed"][final] == records["clean"][final]


def test_the_durable_checkpoints_hold_the_loops_hugging_face_config(runs):
    """``Guard(hf_config=...)`` in live mode: huggingface/ in every durable checkpoint, as under torchrun
    (where test_user_loop_faults.py merges it), so ``trainguard ckpt merge`` needs nothing else."""
    runs, _ = runs
    for checkpoint in sorted((runs / "failed" / "checkpoints").glob("global_step_*")):
        config = json.loads((checkpoint / "huggingface" / "config.json").read_text(encoding="utf-8"))
        assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"], checkpoint


def test_the_loop_sees_each_committed_step_once_with_the_fault_free_losses(runs):
    """Rank 0 prints every step's outcome from ``guard.step``: steps 1..STEPS once each in both runs (the
    recovery, the undo and the redo of the step the killed rank left happen inside one call), with the
    same losses and norms."""
    _, outputs = runs
    # found anywhere in the output: 4 unbuffered processes on one pipe may interleave a line's end
    reports = {name: re.findall(r"step (\d+) loss (\d+\.\d+) norm (\d+\.\d+)", out) for name, out in outputs.items()}
    assert [int(step) for step, _, _ in reports["clean"]] == list(range(1, STEPS + 1))
    assert reports["failed"] == reports["clean"]


def test_the_command_reports_the_run_and_the_replaced_rank(runs):
    _, outputs = runs
    for name, replaced in (("clean", "none"), ("failed", f"[{KILLED}]")):
        assert "(live recovery: 2 replica groups of 2 ranks" in outputs[name]
        assert f"live run finished: {STEPS} steps" in outputs[name] and f"ranks replaced: {replaced}" in outputs[name]


def test_the_local_tier_of_the_loops_yaml_is_saved_by_every_rank(runs):
    """``checkpoint.local_interval: 2`` of user_loop.yaml, now run live: every rank of the fault-free run
    saves its own copy every 2 steps; in the failed run the replaced group's ranks save again once back."""
    runs, _ = runs
    for name in ("clean", "failed"):
        saved = defaultdict(set)
        for event in events_of(runs / name):
            if event["kind"] == "local_saved":
                saved[event["rank"]].add(event["step"])
        assert all(saved[rank] >= {STEPS} for rank in range(WORLD)), (name, dict(saved))
    clean = {e["step"] for e in events_of(runs / "clean") if e["kind"] == "local_saved" and e["rank"] == 0}
    assert clean == set(range(2, STEPS + 1, 2))
