"""``trainguard.Guard`` in live mode (``fault_tolerance.live: true``) in a user's script
(examples/user_loop_live.py), started the way a user starts it: ``trainguard run --nproc 4 --config
examples/user_loop_live.yaml -- python examples/user_loop_live.py`` (4 gloo ranks, 2 replica groups x
2), once without a fault and once with the drill ``--set faults=kill:rank=3,step=5`` and a warm spare
(``--set fault_tolerance.spares=1``). The survivors keep their processes, the replaced group rejoins
with a live peer's state, and every rank ends with the fault-free run's parameters and optimizer state,
bit for bit."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.runs import trainguard
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences, whole_final_state
from trainguard.live.files import events_path
from trainguard.live.samples import sample_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "user_loop_live.py"
CONFIG = EXAMPLE.with_suffix(".yaml")
STEPS, WORLD, GROUP, KILLED, KILL_AT, SAMPLES_PER_STEP = 60, 4, 2, 3, 5, 8 * 8


def _run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [arg for item in (f"train.steps={STEPS}", *overrides) for arg in ("--set", item)]
    return trainguard("run", "--nproc", str(WORLD), "--config", str(CONFIG), "--run-dir", str(run_dir), *sets, "--",
                      sys.executable, str(EXAMPLE), timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_user_loop")
    outputs = {}
    # two warm spares, the first made to fail its self-test (the doctor's miscompute fault): the second
    # replaces the killed rank
    for name, overrides in (("clean", ()), ("failed", (f"faults=kill:rank={KILLED},step={KILL_AT}; miscompute:rep=0,rank=0",
                                                         "fault_tolerance.spares=2"))):
        done = _run(root / name, *overrides)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs[name] = done.stdout
    return root, outputs


def _events(run_dir: Path) -> list[dict]:
    return list(read_events(events_path(run_dir)))


def test_survivors_keep_their_pids_and_the_killed_rank_is_replaced(runs):
    runs, _ = runs
    pids = defaultdict(list)
    for event in _events(runs / "failed"):
        if event["kind"] == "live_start":
            pids[event["rank"]].append(event["pid"])
    assert all(len(pids[rank]) == 1 for rank in range(WORLD) if rank != KILLED), dict(pids)
    assert len(set(pids[KILLED])) == 2, pids[KILLED]
    kill = next(e for e in _events(runs / "failed") if e["kind"] == "live_kill")
    assert (kill["pid"], kill["target"], kill["step"]) == (pids[KILLED][0], KILLED, KILL_AT)


def test_a_spare_that_fails_its_self_test_is_passed_over_for_the_next(runs):
    runs, _ = runs
    events = _events(runs / "failed")
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
    events = _events(runs / "failed")
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    joined = {e["rank"]: e for e in events if e["kind"] == "live_joined"}
    assert sorted(joined) == [2, 3] and all(e["state_bytes"] > 0 for e in joined.values())
    assert all(KILL_AT < e["step"] <= STEPS for e in joined.values())
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}  # the survivors did the group's share
    assert all(len(e["micro_batches"]) == 4 for e in degraded)


def test_final_parameters_and_optimizer_state_equal_the_fault_free_run_bitwise(runs):
    runs, _ = runs
    whole = whole_final_state(runs / "clean", GROUP)
    assert {state["step"].item() for state in whole["optimizer"]["state"].values()} == {STEPS}
    assert run_differences(runs / "clean", runs / "failed", WORLD) == {}
    for name in ("clean", "failed"):
        assert replica_differences(runs / name, WORLD, GROUP) == {}, name


def test_no_sample_lost_or_repeated(runs):
    runs, _ = runs
    for name in ("clean", "failed"):
        assert sample_problems(_events(runs / name), STEPS, SAMPLES_PER_STEP) == [], name


def test_the_loop_body_sees_every_step_on_every_rank(runs):
    """The example prints every 10th step from inside ``for step in guard.steps(...)``: each of the 4
    ranks (the replacement from its join on) reports them, the same losses in both runs."""
    _, outputs = runs
    # found anywhere in the output: 4 unbuffered processes on one pipe may interleave a line's end
    reports = {name: sorted(re.findall(r"step (\d+) loss (\d+\.\d+)", out)) for name, out in outputs.items()}
    assert sorted({int(step) for step, _ in reports["clean"]}) == list(range(0, STEPS, 10))
    assert len(reports["clean"]) == WORLD * len(range(0, STEPS, 10))
    assert set(reports["failed"]) == set(reports["clean"])


def test_the_command_reports_the_run_and_the_replaced_rank(runs):
    _, outputs = runs
    for name, replaced in (("clean", "none"), ("failed", f"[{KILLED}]")):
        assert "(live recovery: 2 replica groups of 2 ranks" in outputs[name]
        assert f"live run finished: {STEPS} steps" in outputs[name] and f"ranks replaced: {replaced}" in outputs[name]
