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

- the same recompute with its restore failing part-way: rank 1 SIGKILLed inside it (``LIVE_LOOP_DIE_IN_RESTORE``:
  its part of ``global_step_2`` read, rank 0 waiting in DCP's closing collective with its own loaded), or
  rank 1's read raising once (``LIVE_LOOP_RAISE_IN_RESTORE``: DCP raises it on every member): the step's
  check, tried again, finds a member mid-restore and restores again rather than compare a state partly the
  checkpoint's (which it would strike as changed at rest), the run recomputes; killed, rank 1 is
  replaced; raised, the copies kept through the failed restore still attribute rank 0. Both end with the
  fault-free run's parameters and optimizer state, bitwise (the raised one with its strike in the book).

Without the strike (``LiveFingerprints`` given no strike book) the first fails (no exit 17, no rank
replaced), without the recompute (``check_replicas`` never restoring) the second ends elsewhere than the
fault-free run, without the copies kept through the checks of the steps recomputed (the check before
step 3 once dropped them) no ``recompute`` mismatch is found, without the mid-restore flag the killed run
strikes rank 0 (``at_rest``) at the retried check, and without the failed load ending the epoch the
raised run ends with exit 1 (every rank raised out of the loop): each checked once by hand.

The six runs start together in one module fixture (``launched``), at most three at a time; each test waits
for its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import live_loop
from helpers.runs import events as events_of, finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.guards.sdc import faulty_ranks_path
from trainguard.live.compare import run_differences

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


def _live(run_dir: Path, setup: dict, *sets: str, **env: str) -> subprocess.CompletedProcess:
    config = _config(run_dir.parent, run_dir.name, setup)
    args = [arg for item in sets for arg in ("--set", item)]
    started = warm_server().start(["run", "--nproc", str(setup["groups"]), "--config", str(config), "--run-dir",
                                   str(run_dir), *args, "--", sys.executable, str(EXAMPLE), "--config", str(config)],
                                  worker_env(**env))
    done = finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _mismatches(run_dir: Path) -> list[tuple]:
    return [(e["step"], e["group"], e["tensors"], e["faulty"], e["how"]) for e in events_of(run_dir, "fingerprint_mismatch")]


# the recompute runs' mismatches: the save of step 4 and the check before step 6, unattributed; then, at that
# check again once recomputed, rank 0's first computation of step 4 (its flipped moment) found wrong
UNATTRIBUTED = [(4, [0, 1], ["state"], [], ["unattributed"]), (6, [0, 1], ["state"], [], ["unattributed"])]
ATTRIBUTED = [(6, [0, 1], ["param:0.weight"], [0], ["recompute"]),
              (6, [0, 1], ["exp_avg_sq:0.weight"], [0], ["recompute"])]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_fingerprints")


@pytest.fixture(scope="module")
def launched(root) -> dict[str, Future]:
    """Every run of the module, started together (most of a run is waits they share), three at a time on the
    small machine; each test waits for its own."""
    flip = f"faults={FLIP}"
    runs = {"struck": lambda: _live(root / "struck", STRIKE, flip),
            "clean_strike": lambda: _live(root / "clean_strike", STRIKE),
            "recomputed": lambda: _live(root / "recomputed", RECOMPUTE, flip),
            "clean_recompute": lambda: _live(root / "clean_recompute", RECOMPUTE),
            "killed_in_restore": lambda: _live(root / "killed_in_restore", RECOMPUTE, flip,
                                               **{live_loop.DIE_IN_RESTORE_ENV: "1"}),
            "raised_in_restore": lambda: _live(root / "raised_in_restore", RECOMPUTE, flip,
                                               **{live_loop.RAISE_IN_RESTORE_ENV: "1"})}
    warm_server()  # the session's server made here, not by several threads at once
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {name: pool.submit(run) for name, run in runs.items()}


@pytest.fixture(scope="module")
def struck(root, launched):
    return root / "struck", launched["struck"].result()


@pytest.fixture(scope="module")
def recomputed(root, launched):
    return root / "recomputed", launched["recomputed"].result()


def test_a_replica_the_majority_attributes_is_repaired_struck_and_at_its_strike_limit_its_group_leaves(struck):
    run_dir, done = struck
    output = done.stdout + done.stderr
    [mismatch] = events_of(run_dir, "fingerprint_mismatch")
    assert (mismatch["step"], mismatch["group"], mismatch["faulty"], mismatch["how"], mismatch["repaired"]) == \
        (FLIP_AT, [0, 1, 2], [0], ["majority"], ["state"])
    assert f"fingerprint mismatch: step {FLIP_AT}, replica group [0, 1, 2], tensor state: rank(s) [0] corrupt " \
           "(majority), repaired from rank 1" in output
    assert f"sdc strike: step {FLIP_AT}, rank 0: fingerprint mismatch (majority); strike 1 of 1 within 8 h; " \
           "the rank is faulty" in output
    assert [(e["target"], e["code"]) for e in events_of(run_dir, "live_exit")] == [(0, 17)]
    assert "ranks replaced: [0]" in done.stdout
    [entry] = json.loads(faulty_ranks_path(run_dir).read_text())
    assert (entry["rank"], [(s["step"], s["kind"]) for s in entry["strikes"]]) == (0, [(FLIP_AT, "fingerprint")])


def test_the_struck_run_ends_bitwise_as_the_fault_free_run(root, launched, struck):
    clean = root / "clean_strike"
    launched["clean_strike"].result()
    assert not events_of(clean, "fingerprint_mismatch")
    # the replacement's strikes were its predecessor's: dropped by every member when it joined
    assert run_differences(clean, struck[0], STRIKE["groups"]) == {}


def test_an_unattributed_mismatch_is_recomputed_from_the_newest_healthy_checkpoint(recomputed):
    run_dir, done = recomputed
    output = done.stdout + done.stderr
    assert _mismatches(run_dir) == UNATTRIBUTED + ATTRIBUTED
    assert [(e["step"], e["to_step"]) for e in events_of(run_dir, "fingerprint_recompute")] == [(6, 2)]
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


def test_the_recomputed_run_ends_bitwise_as_the_fault_free_run(root, launched, recomputed):
    clean = root / "clean_recompute"
    launched["clean_recompute"].result()
    assert not events_of(clean, "fingerprint_mismatch")
    # parameters and optimizer state bitwise the same; the strike against rank 0 is in every member's book
    assert run_differences(clean, recomputed[0], RECOMPUTE["groups"]) == \
        {rank: ["/guards/sdc_strikes/devices: lengths differ"] for rank in range(RECOMPUTE["groups"])}


def test_a_member_killed_inside_the_recompute_restore_is_replaced_and_the_step_restores_again(root, launched):
    run_dir = root / "killed_in_restore"
    done = launched["killed_in_restore"].result()
    output = done.stdout + done.stderr
    assert (run_dir / "died_in_restore_rank_1").exists()  # it did die inside the restore
    assert "fingerprint check at step 6: the restore for a recompute failed part-way (rank(s) [0] mid-restore): " \
           "restoring again" in output
    # rank 0's state, partly restored, is not taken for memory changed at rest (nor struck for it)
    assert _mismatches(run_dir) == UNATTRIBUTED
    assert "sdc strike" not in output
    assert [(e["step"], e["to_step"]) for e in events_of(run_dir, "fingerprint_recompute")] == [(6, 2)]
    assert "ranks replaced: [1]" in done.stdout
    launched["clean_recompute"].result()
    # no strike: the replacement has no copies to measure, so rank 0's alone attribute nothing
    assert run_differences(root / "clean_recompute", run_dir, RECOMPUTE["groups"]) == {}


def test_a_load_that_raises_inside_the_recompute_restore_restores_again_and_still_attributes(root, launched):
    run_dir = root / "raised_in_restore"
    done = launched["raised_in_restore"].result()
    output = done.stdout + done.stderr
    assert (run_dir / "died_in_restore_rank_1").exists()  # its read did raise inside the restore
    assert "fingerprint check at step 6: the restore for a recompute failed part-way (rank(s) [0, 1] " \
           "mid-restore): restoring again" in output
    assert [(e["step"], e["to_step"]) for e in events_of(run_dir, "fingerprint_recompute")] == [(6, 2)]
    assert _mismatches(run_dir) == UNATTRIBUTED + ATTRIBUTED  # nothing struck at rest, rank 0 by the recompute
    assert "sdc strike: step 6, rank 0: fingerprint mismatch (recompute); strike 1 of 3 within 8 h" in output
    assert "ranks replaced: none" in done.stdout
    launched["clean_recompute"].result()
    # as the undisturbed recompute: parameters and optimizer state bitwise the fault-free run's, one strike more
    assert run_differences(root / "clean_recompute", run_dir, RECOMPUTE["groups"]) == \
        {rank: ["/guards/sdc_strikes/devices: lengths differ"] for rank in range(RECOMPUTE["groups"])}
