"""Replica fingerprints in live mode do what the closure mode's do (``live/fingerprint.py``, docs/live_recovery.md):
``trainguard run --nproc N`` of tests/helpers/live_loop.py, N replica groups of one rank, a bit of rank 0's
Adam moment (``exp_avg_sq``) flipped at rest before step 4 (the drill's ``stateflip``), each run against a
fault-free run of the same configuration.

- 3 groups, SDC detection on with ``strikes: 1``, a check before every 2nd step: the check before step 4
  attributes rank 0 (the majority), repairs it from rank 1 and strikes it; at its strike limit rank 0
  writes its ``faulty_ranks.json`` entry (a ``fingerprint`` strike) and exits 17 there, its group leaves,
  is replaced and rejoins, and every rank's final state is the fault-free run's, bitwise;
- 2 groups, a check before every 3rd step, durable saves every 2, SDC detection on with ``strikes: 3``: the
  flip enters step 4's update, so the save of step 4 is marked unhealthy and the check before step 6 finds
  the replicas disagreeing with neither changed at rest; each member keeps a copy of its tensors that
  differ, every member restores step 2's checkpoint (the newest healthy one, its restored state hashing
  as its save held it) and recomputes steps 3 to 5 (``fingerprint_recompute``); at the check before step
  6 again the copies' distances to the recomputed tensors attribute the mismatch to rank 0 (``recompute``),
  struck once; every rank's final parameters and optimizer state are the fault-free run's, bitwise.

Without the strike (``LiveFingerprints`` given no strike book) the first fails (no exit 17, no rank
replaced), without the recompute (``check_replicas`` never restoring) the second ends elsewhere than the
fault-free run, and without the copies kept through the checks of the steps recomputed (the check
before step 3 once dropped them) no ``recompute`` mismatch is found: each checked once by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.events.log import read_events
from trainguard.guards.sdc import faulty_ranks_path
from trainguard.live.compare import run_differences
from trainguard.live.files import events_path

EXAMPLE = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "live_loop.py"
FLIP_AT = 4
FLIP = f"stateflip:rank=0,step={FLIP_AT},site=0.weight,state=exp_avg_sq"
TIMEOUT_S = 240
STRIKE = {"groups": 3, "steps": 6, "interval": 2, "saves": 3, "guards": "sdc: {enabled_level: 2, strikes: 1}, "}
RECOMPUTE = {"groups": 2, "steps": 7, "interval": 3, "saves": 2, "guards": "sdc: {enabled_level: 2, strikes: 3}, "}


def _config(root: Path, name: str, setup: dict) -> Path:
    config = root / f"{name}.yaml"
    config.write_text(f"parallel: {{dp_replicate: {setup['groups']}, dp_shard: 1}}\n"
                      f"train: {{steps: {setup['steps']}, micro_batches: 6}}\n"
                      "fault_tolerance: {live: true}\n"
                      f"checkpoint: {{save_interval: {setup['saves']}}}\n"
                      f"guards: {{{setup['guards']}fingerprint: {{interval: {setup['interval']}}}}}\n")
    return config


def _live(run_dir: Path, setup: dict, *sets: str) -> subprocess.CompletedProcess:
    config = _config(run_dir.parent, run_dir.name, setup)
    args = [arg for item in sets for arg in ("--set", item)]
    started = warm_server().start(["run", "--nproc", str(setup["groups"]), "--config", str(config), "--run-dir",
                                   str(run_dir), *args, "--", sys.executable, str(EXAMPLE), "--config", str(config)],
                                  worker_env())
    done = finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [event for event in read_events(events_path(run_dir)) if event["kind"] == kind]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_fingerprints")


@pytest.fixture(scope="module")
def struck(root):
    run_dir = root / "struck"
    return run_dir, _live(run_dir, STRIKE, f"faults={FLIP}")


@pytest.fixture(scope="module")
def recomputed(root):
    run_dir = root / "recomputed"
    return run_dir, _live(run_dir, RECOMPUTE, f"faults={FLIP}")


def test_a_replica_the_majority_attributes_is_repaired_struck_and_at_its_strike_limit_its_group_leaves(struck):
    run_dir, done = struck
    output = done.stdout + done.stderr
    [mismatch] = _events(run_dir, "fingerprint_mismatch")
    assert (mismatch["step"], mismatch["group"], mismatch["faulty"], mismatch["how"], mismatch["repaired"]) == \
        (FLIP_AT, [0, 1, 2], [0], ["majority"], ["state"])
    assert f"fingerprint mismatch: step {FLIP_AT}, replica group [0, 1, 2], tensor state: rank(s) [0] corrupt " \
           "(majority), repaired from rank 1" in output
    assert f"sdc strike: step {FLIP_AT}, rank 0: fingerprint mismatch (majority); strike 1 of 1 within 8 h; " \
           "the rank is faulty" in output
    assert [(e["target"], e["code"]) for e in _events(run_dir, "live_exit")] == [(0, 17)]
    assert "ranks replaced: [0]" in done.stdout
    [entry] = json.loads(faulty_ranks_path(run_dir).read_text())
    assert (entry["rank"], [(s["step"], s["kind"]) for s in entry["strikes"]]) == (0, [(FLIP_AT, "fingerprint")])


def test_the_struck_run_ends_bitwise_as_the_fault_free_run(root, struck):
    clean = root / "clean_strike"
    _live(clean, STRIKE)
    assert not _events(clean, "fingerprint_mismatch")
    # the replacement's strikes were its predecessor's: dropped by every member when it joined
    assert run_differences(clean, struck[0], STRIKE["groups"]) == {}


def test_an_unattributed_mismatch_is_recomputed_from_the_newest_healthy_checkpoint(recomputed):
    run_dir, done = recomputed
    output = done.stdout + done.stderr
    # the save of step 4, the check before step 6, then that check again once recomputed: rank 0's first
    # computation of step 4 (its flipped moment) was wrong
    assert [(e["step"], e["group"], e["tensors"], e["faulty"], e["how"])
            for e in _events(run_dir, "fingerprint_mismatch")] == \
        [(4, [0, 1], ["state"], [], ["unattributed"]), (6, [0, 1], ["state"], [], ["unattributed"]),
         (6, [0, 1], ["param:0.weight"], [0], ["recompute"]), (6, [0, 1], ["exp_avg_sq:0.weight"], [0], ["recompute"])]
    assert [(e["step"], e["to_step"]) for e in _events(run_dir, "fingerprint_recompute")] == [(6, 2)]
    assert "fingerprint mismatch at step 6 that no replica can repair: recomputing from global_step_2, the last " \
           "agreeing state" in output
    assert "does not hold the state hashed" not in output  # the restored state hashes as its save held it
    assert "fingerprint mismatch: step 6, replica group [0, 1], tensor exp_avg_sq:0.weight: rank(s) [0] corrupt " \
           "(recompute), repaired by the recompute" in output
    assert "sdc strike: step 6, rank 0: fingerprint mismatch (recompute); strike 1 of 3 within 8 h" in output
    assert "rolled back to step 2" in done.stdout
    # the unhealthy save of step 4 was abandoned with its timeline; the recompute saved it again, healthy
    health = {info.step: info.manifest.health for info in list_checkpoints(run_dir / "checkpoints")}
    assert FLIP_AT in health and set(health.values()) == {None}, health


def test_the_recomputed_run_ends_bitwise_as_the_fault_free_run(root, recomputed):
    clean = root / "clean_recompute"
    _live(clean, RECOMPUTE)
    assert not _events(clean, "fingerprint_mismatch")
    # parameters and optimizer state bitwise the same; the strike against rank 0 is in every member's book
    assert run_differences(clean, recomputed[0], RECOMPUTE["groups"]) == \
        {rank: ["/guards/sdc_strikes/devices: lengths differ"] for rank in range(RECOMPUTE["groups"])}
