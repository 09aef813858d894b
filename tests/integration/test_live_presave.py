"""Every durable save of a live run checks the replicas first, as the closure mode's ``before_save``
(``guards.fingerprint`` on, its ``interval`` too large for any check before a step; docs/live_recovery.md):
``trainguard run --nproc N`` of tests/helpers/live_loop.py, N replica groups of one rank, 5 steps, a
durable save at step 5 (the job's last), a bit of rank 0's Adam moment (``exp_avg_sq``: the summed gradient
stays the fault-free run's) flipped at rest before step 5 (the drill's ``stateflip``).

- 3 groups: the save's check attributes rank 0 (the majority), repairs it from a replica, and the
  checkpoint of step 5 and every rank's final state are the fault-free run's, bitwise;
- 2 groups: nothing attributes the disagreement; the checkpoint of step 5 is marked unhealthy as the
  closure mode marks one (``reason: replicas disagree`` in the manifest and ``health_ckpts.json``), and
  the next start (``--resume auto``) passes it over for step 4's.

Without the check (the save's health the embedding norm's only) both fail: checked once by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.live_tensors import durable_tensors, final_tensors
from helpers.runs import finish_session, worker_env
from helpers.warm_command import warm_server
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences
from trainguard.live.files import events_path

EXAMPLE = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "live_loop.py"
STEPS = 5
FLIP = f"stateflip:rank=0,step={STEPS},site=0.weight,state=exp_avg_sq"
TIMEOUT_S = 240


def _config(root: Path, groups: int) -> Path:
    config = root / f"presave_{groups}.yaml"
    config.write_text(f"parallel: {{dp_replicate: {groups}, dp_shard: 1}}\n"
                      f"train: {{steps: {STEPS}, micro_batches: 6}}\n"
                      "fault_tolerance: {live: true}\n"
                      "checkpoint: {save_interval: 4}\n"
                      "guards: {fingerprint: {interval: 1000}}\n")
    return config


def _live(run_dir: Path, groups: int, *sets: str) -> subprocess.CompletedProcess:
    config = _config(run_dir.parent, groups)
    args = [arg for item in sets for arg in ("--set", item)]
    started = warm_server().start(["run", "--nproc", str(groups), "--config", str(config), "--run-dir", str(run_dir),
                                   *args, "--", sys.executable, str(EXAMPLE), "--config", str(config)], worker_env())
    done = finish_session(started, TIMEOUT_S, f"the live run {run_dir.name}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _mismatches(run_dir: Path) -> list[tuple]:
    return [(e["step"], e["group"], e["faulty"], e["repaired"])
            for e in read_events(events_path(run_dir)) if e["kind"] == "fingerprint_mismatch"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("live_presave")


def test_a_replica_the_majority_attributes_is_repaired_before_the_save_which_holds_the_majoritys_state(root):
    clean, flipped = root / "clean3", root / "flipped3"
    _live(clean, 3)
    done = _live(flipped, 3, f"faults={FLIP}")
    assert _mismatches(flipped) == [(STEPS, [0, 1, 2], [0], ["state"])]
    assert f"fingerprint mismatch: step {STEPS}, replica group [0, 1, 2], tensor state: rank(s) [0] corrupt " \
           "(majority), repaired from rank 1" in done.stdout + done.stderr
    assert replica_differences(flipped, 3, 1) == {}
    for rank in range(3):
        mine, reference = final_tensors(flipped, rank), final_tensors(clean, rank)
        assert [name for name in reference if not torch.equal(mine[name], reference[name])] == [], rank
    saved, reference = durable_tensors(flipped, STEPS), durable_tensors(clean, STEPS)
    assert saved.keys() == reference.keys()
    assert [name for name in reference if not torch.equal(saved[name], reference[name])] == []
    assert all(info.manifest.health is None for info in list_checkpoints(flipped / "checkpoints"))


def test_an_unattributed_disagreement_marks_the_save_unhealthy_and_the_resume_passes_it_over(root):
    run_dir = root / "flipped2"
    done = _live(run_dir, 2, f"faults={FLIP}")
    assert _mismatches(run_dir) == [(STEPS, [0, 1], [], [])]
    assert f"checkpoint of step {STEPS} is unhealthy and will not be resumed from: " \
           "{'reason': 'replicas disagree', 'fingerprint_groups': 2}" in done.stdout + done.stderr
    health = {info.step: info.manifest.health for info in list_checkpoints(run_dir / "checkpoints")}
    assert health == {4: None, STEPS: {"is_health": 1, "reason": "replicas disagree", "fingerprint_groups": 2}}
    records = json.loads((run_dir / "checkpoints" / "health_ckpts.json").read_text())
    assert [(r["ckpt_name"], r["is_health"]) for r in records] == [(f"global_step_{STEPS}", 1)]
    resumed = _live(run_dir, 2)
    assert f"live run resumes from {run_dir / 'checkpoints' / 'global_step_4'}" in resumed.stdout
