"""The supervisor understands any script under any launcher: a rank's intended exit code and the failing
rank come from the heartbeat exit record the rank wrote before exiting, not from the launcher's code
(torchrun turns every rank's code into 1)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from helpers.runs import events, trainguard, worker_env

# a user's script: heartbeats through trainguard's writer, no torch; rank FAIL_RANK exits FAIL_CODE
# (on FAIL_NODE only, when given), the other ranks exit 0
SCRIPT = textwrap.dedent("""
    import os, sys, time
    from trainguard.runtime.heartbeat import HeartbeatWriter

    rank = int(os.environ["RANK"])
    beats = HeartbeatWriter(sys.argv[1], rank)
    beats.beat("train", 0)
    beats.beat("step", 1)
    failing = rank == int(os.environ["FAIL_RANK"]) and os.environ.get("FAIL_NODE", os.environ["TRAINGUARD_NODE"]) == os.environ["TRAINGUARD_NODE"]
    code = int(os.environ["FAIL_CODE"]) if failing else 0
    if not failing:
        time.sleep(0.5)
    beats.beat("exit", 1, code)
    sys.exit(code)
""")

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
LAUNCHERS = {"torchrun": [TORCHRUN], "torch.distributed.run": [sys.executable, "-m", "torch.distributed.run"]}


def supervise(tmp_path: Path, launcher: str, code: int, *supervisor_args: str, **env: str):
    script = tmp_path / "user_loop.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    proc = trainguard("run", "--run-dir", str(run), "--max-restarts", "2", "--backoff", "0", *supervisor_args, "--",
                      *LAUNCHERS[launcher], "--standalone", "--nproc-per-node", "2", str(script), str(run),
                      env=worker_env(FAIL_RANK="1", FAIL_CODE=str(code), **env), timeout=300)
    return run, proc


@pytest.mark.parametrize("code,outcome,launcher", [(3, "failed", "torchrun"), (16, "stopped", "torch.distributed.run")])
def test_an_intended_exit_through_torchrun_is_passed_on_not_restarted(tmp_path, code, outcome, launcher):
    run, proc = supervise(tmp_path, launcher, code)
    assert proc.returncode == code, proc.stderr
    assert events(run, "restart") == []
    ended = events(run, "incarnation_ended")
    assert len(ended) == 1 and ended[0]["outcome"] == outcome
    # what the launcher said: the supervisor starts the torchrun of its own installation quieted
    # (runtime/quiet_torchrun.py: the rank's code, no ChildFailedError block); torch.distributed.run as given
    assert ended[0]["exit_codes"] == {"node0": code if launcher == "torchrun" else 1}
    assert ("ChildFailedError" in proc.stderr) == (launcher != "torchrun"), proc.stderr
    assert ended[0]["rank_exit_codes"]["1"] == code  # what the rank said (torchrun then killed rank 0)
    if code == 16:  # a stop is not a failure: no failing rank
        assert ended[0]["failing_rank"] is None
    else:
        assert ended[0]["failing_rank"] == 1 and ended[0]["failing_node"] == "node0"
        assert "rank 1 on node0 exited 3" in ended[0]["detail"]


def test_exit_17_through_torchrun_names_the_rank_and_excludes_its_node(tmp_path):
    run, proc = supervise(tmp_path, "torchrun", 17, "--spare-nodes", "1", FAIL_NODE="node0")
    assert proc.returncode == 0, proc.stderr
    excluded = events(run, "node_excluded")
    assert [(e["node"], e["ranks"], e["spare"]) for e in excluded] == [("node0", [1], "node1")]
    assert "rank 1 on node0" in proc.stderr and "rank None" not in proc.stderr
    assert [e["outcome"] for e in events(run, "incarnation_ended")] == ["failed", "finished"]
