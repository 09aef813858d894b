"""Replica fingerprints on real gloo ranks: a flipped weight or Adam moment bit is found, attributed
to the right rank, repaired from a replica, and the run ends bitwise equal to a fault-free one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.replica_worker import build, train_replica

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "replica_worker.py"
STEPS = 9


def run_replicas(tmp_path: Path, world: int, faults: str, interval: int = 3) -> list[dict]:
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world", str(world),
                               "--store", str(store), "--out", str(tmp_path), "--steps", str(STEPS),
                               "--interval", str(interval), "--faults", faults],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def fault_free_state() -> dict[str, torch.Tensor]:
    model, optimizer = build()
    train_replica(STEPS, model, optimizer)
    state = {f"param:{name}": p.detach() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        state.update({f"{key}:{name}": value for key, value in optimizer.state[p].items()})
    return state


def assert_bitwise_equal(state: dict, reference: dict) -> None:
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key].view(torch.uint8) if state[key].dim() else state[key],
                           value.view(torch.uint8) if value.dim() else value), key


def test_two_replicas_a_flip_at_rest_is_attributed_repaired_and_leaves_no_trace(tmp_path):
    # steps 3 and 6 are fingerprint steps (interval 3): each flip lands between the previous step's
    # update and the check, one in an Adam moment, one in a weight
    faults = ("stateflip:rank=1,step=3,site=2.weight,state=exp_avg,index=5,bit=26;"
              "stateflip:rank=1,step=6,site=0.weight,state=weight,index=7,bit=25")
    results = run_replicas(tmp_path, 2, faults)
    reference = fault_free_state()
    for result in results:
        assert_bitwise_equal(result["state"], reference)
        assert result["health"] is None  # a clean save: nothing poisoned, replicas agree
    mismatches = [e for e in results[0]["events"] if e["kind"] == "fingerprint_mismatch"]
    assert [(e["step"], e["tensors"], e["faulty"], e["how"], e["repaired"]) for e in mismatches] == [
        (3, ["exp_avg:2.weight"], [1], ["at_rest"], ["exp_avg:2.weight"]),
        (6, ["param:0.weight"], [1], ["at_rest"], ["param:0.weight"])]
    assert [s["kind"] for s in results[1]["strikes"]] == ["fingerprint"] * 2 and results[0]["strikes"] == []
    fired = [e for e in results[1]["events"] if e["kind"] == "fault_injected"]
    assert [e["state"] for e in fired] == ["exp_avg", "weight"] and all(e["flipped"] for e in fired)


def test_three_replicas_a_flip_that_entered_the_update_is_outvoted_and_repaired(tmp_path):
    # step 4 is no fingerprint step: the flipped weight trains one step on rank 2 before the check at 6
    results = run_replicas(tmp_path, 3, "stateflip:rank=2,step=4,site=0.weight,state=weight,index=3,bit=27")
    reference = fault_free_state()
    for result in results:
        assert_bitwise_equal(result["state"], reference)
    (mismatch,) = [e for e in results[0]["events"] if e["kind"] == "fingerprint_mismatch"]
    assert mismatch["step"] == 6 and mismatch["faulty"] == [2] and mismatch["how"] == ["majority"]
    assert set(mismatch["repaired"]) == set(mismatch["tensors"]) and "param:0.weight" in mismatch["tensors"]
    assert [s["kind"] for s in results[2]["strikes"]] == ["fingerprint"]


def test_two_replicas_that_diverged_in_an_update_are_never_saved_as_healthy(tmp_path):
    results = run_replicas(tmp_path, 2, "stateflip:rank=1,step=4,site=0.weight,state=weight,index=3,bit=27")
    for result in results:
        assert result["health"]["is_health"] == 1 and result["health"]["reason"] == "replicas disagree"
    (mismatch,) = [e for e in results[0]["events"] if e["kind"] == "fingerprint_mismatch" and e["step"] == 6]
    assert mismatch["how"] == ["unattributed"] and mismatch["faulty"] == [] and mismatch["repaired"] == []
