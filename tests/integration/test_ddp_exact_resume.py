"""Exact resume of a user's DDP loop (tests/helpers/ddp_loop.py: 4 gloo ranks, ``DistributedDataParallel``,
not FSDP2) on trainguard.Guard, killed at step 5 and resumed from global_step_4 (issue 38 item 12).

DDP rebuilds its gradient buckets at the first step of every process (in the order the gradients became
ready), so the first step after a resume reduces with the initial bucket layout while the run that never
stopped uses the rebuilt one: with 4 ranks the ring all-reduce then sums in another order, and the
resumed step's global norm differed in its last digits (measured 0x1.b6241c615c748p-1 against
0x1.b6241c4aa84e3p-1: 2.2e-8 relative). ``DDP(..., find_unused_parameters=True)`` keeps the initial
buckets for ever (torch rebuilds only without it, or with ``static_graph``): killed and resumed, the run
is then bitwise equal to the one that never stopped, which this test checks."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.runs import assert_same_tensors, torchrun, worker_env

LOOP = Path(__file__).resolve().parents[1] / "helpers" / "ddp_loop.py"
STEPS = 6
RANKS = 4
TIMEOUT_S = 400


def run_loop(run_dir: Path, faults: str | None = None):
    env = worker_env(DDP_FIND_UNUSED_PARAMETERS="1", **({"TRAINGUARD_FAULTS": faults} if faults else {}))
    return torchrun(LOOP, "--run-dir", str(run_dir), "--steps", str(STEPS), "--set", "checkpoint.save_interval=2",
                    "--set", "checkpoint.async_save=false", nproc=RANKS, env=env, timeout=TIMEOUT_S)


def norms(output: str) -> dict[int, str]:
    return {int(step): norm for step, norm in re.findall(r"^outcome step=(\d+) norm=(\S+)", output, flags=re.M)}


def test_a_ddp_loop_killed_and_resumed_is_bitwise_with_its_initial_buckets_kept(tmp_path):
    straight = run_loop(tmp_path / "straight")
    assert straight.returncode == 0, straight.stdout[-4000:]
    assert "DDP rebuilds its gradient buckets" not in straight.stdout  # Guard warns only when DDP would rebuild
    run_dir = tmp_path / "killed"
    killed = run_loop(run_dir, faults="kill:rank=1,step=5")
    assert killed.returncode != 0 and 5 not in norms(killed.stdout), killed.stdout[-3000:]
    resumed = run_loop(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    clean, again = norms(straight.stdout), norms(resumed.stdout)
    assert sorted(again) == [5, 6] and all(again[s] == clean[s] for s in again), (clean, again)  # every digit
    final = "checkpoints/global_step_6"
    assert assert_same_tensors(tmp_path / "straight" / final, run_dir / final) > 0
