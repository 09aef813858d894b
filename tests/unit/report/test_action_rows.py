"""The report's table of restarts and recovery actions names the rank and node that failed. The
supervisor writes its events as rank -1, and a restart carries the failed one as ``failing_rank`` and
``failing_node``: `trainguard demo --quick`'s report once showed its SIGKILL's restart as rank -1 on
node "-" (the events below are that run's, trimmed)."""

from __future__ import annotations

import json

from trainguard.report import read_run

RESTART = {"time": 1_800_000_005.9, "kind": "restart", "step": 7, "rank": -1, "host": "vm", "incarnation": 1,
           "reason": "failed", "exit_code": 1, "failing_rank": 3, "failing_node": "node1",
           "detail": "rank 3 on node1 failed (signal SIGKILL)", "backoff": 0.5, "restarts": 1}
RECOVERY = {"time": 1_800_000_011.7, "kind": "local_recovery", "step": 6, "rank": 0, "host": "vm", "seconds": 1.78}


def test_a_restart_row_names_the_failed_rank_and_node_and_other_rows_keep_their_own(tmp_path):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (RESTART, RECOVERY)))
    rows = {action.kind: action for action in read_run(tmp_path).actions}
    assert (rows["restart"].rank, rows["restart"].node) == (3, "node1")
    assert (rows["local_recovery"].rank, rows["local_recovery"].node, rows["local_recovery"].seconds) == (0, None, 1.78)
