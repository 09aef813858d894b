"""SDC detection with its rerun in live mode (``live/sdc.py``), on the documented user path
(``trainguard run --nproc 4 --config FILE -- python tests/helpers/live_loop.py``: 4 gloo ranks, 2 replica
groups x 2, dropout, AdamW, durable checkpoints every 5 steps), ``guards.sdc.enabled_level: 2`` with
``strikes: 1``, once fault-free and once with the drill's miscompute on rank 1 at step 4 (the closure
mode's ``scale`` fault: the gradient into the LayerNorm of rank 1's first micro-batch of step 4, x1e9,
once):

- every rank judges the same values (the module point's per-micro-batch values ride in the sum), so the
  detection is the quorum's at step 4 only, naming rank 1 as the rank that computed the abnormal value;
  the rerun differs (the fault was transient): a strike against rank 1, which with ``strikes: 1`` makes it
  faulty: it writes its ``faulty_ranks.json`` entry and exits 17, the others go on, it is replaced and its
  group rejoins;
- the run uses the rerun's clean sum, so it ends with every rank's parameters and optimizer state bitwise
  the fault-free run's, and the replacement's strikes were dropped when it joined;
- the closure mode (``helpers/user_loop_closure.py``: the same script, data and draws in one process),
  with the same fault on its only rank, catches it at the same step, at the same points, with the same
  verdict (and exits 17: a restart excludes its device there);
- replica fingerprints (``guards.fingerprint.interval: 2``): a bit of rank 2's first weight flipped at rest
  before step 4 (the drill's ``stateflip``) is found by the check before step 4, attributed to rank 2 (its
  state changed since its own update; its replica, rank 0, did not), repaired from rank 0 before anything
  is computed with it, and struck (``strikes: 1``: rank 2 exits 17 before step 4 and is replaced, as an
  SDC-struck rank is), and the run ends with every rank's whole final state bitwise the fault-free run's
  (without the check the run ends elsewhere, and SDC detection strikes rank 2 out: checked once).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import events as events_of, finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.events.log import read_events
from trainguard.guards.sdc import faulty_ranks_path
from trainguard.live.compare import bitwise_differences, replica_differences, run_differences
from trainguard.live.files import events_path, final_path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "helpers" / "live_loop.py"
CLOSURE_TWIN = ROOT / "tests" / "helpers" / "user_loop_closure.py"
STEPS, WORLD, FAULT_AT = 10, 4, 4
MISCOMPUTE = "scale:rank={rank},step=4,site=2,where=grad_input,factor=1e9"  # module "2": the LayerNorm
STATE_FLIP = "stateflip:rank=2,step=4,site=0.weight,state=weight"  # an exponent bit of rank 2's first weight
TIMEOUT_S = 240


def _config(root: Path) -> Path:
    config = root / "live_sdc.yaml"
    config.write_text(EXAMPLE.with_suffix(".yaml").read_text().replace("steps: 60", f"steps: {STEPS}")
                      + "checkpoint: {save_interval: 5}\n"
                      + "guards: {sdc: {enabled_level: 2, strikes: 1}}\n")
    return config


def _live(run_dir: Path, config: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [arg for item in sets for arg in ("--set", item)]
    started = warm_server().start(["run", "--nproc", str(WORLD), "--config", str(config), "--run-dir", str(run_dir),
                                   *args, "--", sys.executable, str(EXAMPLE), "--config", str(config)], worker_env())
    done = finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _final(run_dir: Path, rank: int) -> dict:
    return safe_torch_load(final_path(run_dir, rank))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_sdc")


@pytest.fixture(scope="module")
def clean(root):
    _live(root / "clean", _config(root))
    return root / "clean"


@pytest.fixture(scope="module")
def struck(root):
    return root / "struck", _live(root / "struck", _config(root), f"faults={MISCOMPUTE.format(rank=1)}")


def test_a_fault_free_run_with_sdc_on_detects_nothing_and_its_replicas_agree(clean):
    assert [e["names"] for e in events_of(clean, "sdc_points")][0][0] == "2"  # the LayerNorm, then the gradients
    assert not [e for e in read_events(events_path(clean)) if e["kind"] in ("sdc_detected", "sdc_rerun")]
    assert replica_differences(clean, WORLD, 2) == {}  # the detectors' state too: every rank's alike


def test_a_miscompute_on_one_rank_is_caught_by_the_quorum_rerun_and_the_struck_out_rank_replaced(struck):
    run_dir, done = struck
    detected = events_of(run_dir, "sdc_detected")
    assert {e["step"] for e in detected} == {FAULT_AT}
    assert [e["computed_by"] for e in detected if e["point"] == "2"] == [[1]]
    for rank in range(WORLD):  # the closure mode's line, in every rank's log
        assert f"accuracy sensitivity feature abnormal: step {FAULT_AT}, rank {rank}, " in done.stdout + done.stderr
    [rerun] = events_of(run_dir, "sdc_rerun")
    assert (rerun["verdict"], rerun["reran"], rerun["ranks"]) == ("faulty", True, [1])
    [attribution] = events_of(run_dir, "sdc_attribution")
    assert (attribution["rank"], attribution["attribution"], attribution["strikes"], attribution["faulty"]) == \
        (1, "transient", 1, True)
    assert [(e["target"], e["code"]) for e in events_of(run_dir, "live_exit")] == [(1, 17)]
    assert "ranks replaced: [1]" in done.stdout
    [entry] = json.loads(faulty_ranks_path(run_dir).read_text())
    assert (entry["rank"], entry["local_device"], [s["step"] for s in entry["strikes"]]) == (1, "cpu:1", [FAULT_AT])


def test_the_struck_run_uses_the_clean_rerun_and_ends_bitwise_as_the_fault_free_run(clean, struck):
    run_dir, _ = struck
    for rank in range(WORLD):
        mine, reference = _final(run_dir, rank), _final(clean, rank)
        assert bitwise_differences({k: mine[k] for k in ("model", "optimizer")},
                                   {k: reference[k] for k in ("model", "optimizer")}) == [], rank
        # the replacement's strikes were its predecessor's: dropped by every member when it joined
        assert mine["guards"]["sdc_strikes"] == reference["guards"]["sdc_strikes"], rank


def test_the_closure_mode_catches_the_same_fault_at_the_same_step_with_the_same_verdict(root, struck):
    run_dir, _ = struck
    twin = root / "closure"
    done = subprocess.run([sys.executable, str(CLOSURE_TWIN), "--config", str(_config(root)), "--run-dir", str(twin),
                           "--set", f"faults={MISCOMPUTE.format(rank=0)}"],
                          env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 17, done.stdout[-3000:] + done.stderr[-3000:]

    def caught(run: Path) -> list[tuple]:
        # the live groups shard the parameters (dp_shard 2): a parameter gradient's point there is one per
        # shard (``grad:NAME (shard S)``), the whole parameter's in the one-process twin
        return list(dict.fromkeys((e["step"], e["point"].split(" (shard ")[0], e["level"])
                                  for e in events_of(run, "sdc_detected")))

    assert caught(twin) == caught(run_dir)
    assert [(e["step"], e["verdict"]) for e in events_of(twin, "sdc_rerun")] == \
        [(e["step"], e["verdict"]) for e in events_of(run_dir, "sdc_rerun")]


def test_a_flip_at_rest_is_found_by_the_replica_fingerprints_and_repaired_from_a_replica(root, clean):
    run_dir = root / "flipped"
    done = _live(run_dir, _config(root), "guards.fingerprint.interval=2", f"faults={STATE_FLIP}")
    [mismatch] = events_of(run_dir, "fingerprint_mismatch")
    assert (mismatch["step"], mismatch["group"], mismatch["faulty"], mismatch["how"], mismatch["repaired"]) == \
        (FAULT_AT, [0, 2], [2], ["at_rest"], ["state"])
    assert "fingerprint mismatch: step 4, replica group [0, 2], tensor state: rank(s) [2] corrupt (at_rest), " \
           "repaired from rank 0" in done.stdout
    # struck as the closure mode strikes it: at ``strikes: 1`` rank 2 exits 17 there and is replaced
    assert "sdc strike: step 4, rank 2: fingerprint mismatch (at_rest); strike 1 of 1 within 8 h; the rank is " \
           "faulty" in done.stdout + done.stderr
    assert [(e["target"], e["code"]) for e in events_of(run_dir, "live_exit")] == [(2, 17)]
    assert "ranks replaced: [2]" in done.stdout and not events_of(run_dir, "sdc_detected")
    assert run_differences(clean, run_dir, WORLD) == {}
