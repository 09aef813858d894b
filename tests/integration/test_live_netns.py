"""Live recovery (issue 23) across separate hosts: 4 gloo ranks in 2 replica groups x 2, each group on a
node of its own (network namespaces, ``helpers/netns_cluster.py``), two warm spares on a third node, the
store and the lighthouse on the head node. Mid-run the link of group 1's node is really cut (``ip link
set tg0 down`` inside it): its ranks can reach neither their peers nor the store. The survivors find
them silent, carry on alone without restarting, the spares on n3 take their ranks and receive the state
from a live peer on n1; then the cut node's link comes back and its stale ranks, fenced by epoch, stop
instead of rejoining. The end state is bitwise the fault-free run's, every sample used once."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.netns_cluster import HEAD
from helpers.runs import worker_env
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences, whole_final_state
from trainguard.live.files import events_path
from trainguard.live.launcher import LiveRun, launch
from trainguard.live.samples import sample_problems
from trainguard.live.worker import FENCED_EXIT
from trainguard.live.workload import Workload

HELPER = Path(__file__).parent.parent / "helpers" / "live_on_nodes.py"
CUT_AT = 8  # group 1's node loses its link once its rank 2 has committed this step
CUT = "n2"
# long enough after the rejoin (about 10 s) for the stale ranks to come back before the end: their store
# connection resumes at TCP's next retransmission, which backs off while the link is down (seen: 2.7 s
# after the link came back, from a 4 s cut)
RUN = LiveRun(groups=2, group_size=2, steps=100, micro_batch_s=0.05, hang_s=4.0, spares=2, checkpoint_every=0,
              nodes=("n1", CUT, "n3", "n3"))


def _events(run_dir: Path) -> list[dict]:
    return list(read_events(events_path(run_dir))) if events_path(run_dir).exists() else []


def _wait(run_dir: Path, what, timeout: float = 90) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in _events(run_dir) if what(e)]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no such event in {run_dir} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def cut_run(netns, tmp_path_factory):
    root = tmp_path_factory.mktemp("live_netns")
    run = dataclasses.replace(RUN, node_command=f"ip netns exec {netns.ns('{node}')}", store_host=netns.address(HEAD))
    seen: dict = {}

    def cut_then_restore() -> None:
        _wait(root / "cut", lambda e: e["kind"] == "live_step" and e["rank"] == 2 and e["step"] >= CUT_AT)
        netns.cut_link(CUT)
        seen["cut_at"] = time.time()
        seen["pids"] = {node: netns.pids_of(node) for node in ("n1", CUT, "n3")}
        # the lighthouse has fenced both and the survivors have gone on alone: the link comes back
        _wait(root / "cut", lambda e: e["kind"] == "live_quorum" and e["left"])
        netns.restore_link(CUT)
        seen["restored_at"] = time.time()

    helper = threading.Thread(target=cut_then_restore, daemon=True)
    helper.start()
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
    done = subprocess.run(netns.on_head([sys.executable, str(HELPER), str(root / "cut"), str(root / "result.json"),
                                         json.dumps(fields)]),
                          env=worker_env(GLOO_SOCKET_IFNAME="tg0"), capture_output=True, text=True, timeout=200)
    helper.join(timeout=5)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((root / "result.json").read_text())
    launch(root / "clean", dataclasses.replace(RUN, spares=0, nodes=()))  # fault-free, local
    return root, result, seen


def test_survivors_keep_their_processes_and_spares_on_another_node_replace_the_cut_ranks(cut_run):
    root, result, seen = cut_run
    first = {int(r): p for r, p in result["first_pids"].items()}
    last = {int(r): p for r, p in result["last_pids"].items()}
    assert [first[r] == last[r] for r in range(4)] == [True, True, False, False]
    assert result["exit_codes"] == {str(r): 0 for r in range(4)}
    # each process ran on its node (its network namespace, at the cut): the survivors on n1, the cut
    # ranks on n2, the spares that became their replacements on n3
    assert {first[0], first[1]} <= seen["pids"]["n1"] and {first[2], first[3]} <= seen["pids"][CUT]
    assert {last[2], last[3]} <= seen["pids"]["n3"]
    starts = {(e["rank"], e["pid"], e["rejoin"]) for e in _events(root / "cut") if e["kind"] == "live_start"}
    assert starts == {(0, first[0], False), (1, first[1], False), (2, first[2], False), (3, first[3], False),
                      (2, last[2], True), (3, last[3], True)}


def test_the_cut_is_found_silent_the_group_leaves_and_rejoins_from_a_live_peer(cut_run):
    root, _, seen = cut_run
    events = _events(root / "cut")
    hung = [e for e in events if e["kind"] == "live_hung"]
    assert sorted(e["target"] for e in hung) == [2, 3]
    assert all(e["time"] > seen["cut_at"] and e["silent_s"] >= RUN.hang_s for e in hung)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert quorums[1]["left"] == [2, 3] and "hung, fenced: [2, 3]" in quorums[1]["reason"]
    assert quorums[2]["joining"] == [2, 3] and quorums[1]["step"] >= CUT_AT
    joined = {e["rank"]: e for e in events if e["kind"] == "live_joined"}
    assert sorted(joined) == [2, 3] and all(e["state_bytes"] > 0 for e in joined.values())
    # the survivors stepped alone (each computing 4 of the 8 micro-batches) between the two epochs
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert {e["rank"] for e in degraded} == {0, 1}
    assert all(len(e["micro_batches"]) == Workload().micro_batches // 2 for e in degraded)


def test_the_cut_ranks_come_back_stale_and_are_fenced_by_epoch(cut_run):
    root, result, _ = cut_run
    first = {int(r): p for r, p in result["first_pids"].items()}
    events = _events(root / "cut")
    fenced = {(e["rank"], e["pid"], e["epoch"], e["fence_epoch"]) for e in events if e["kind"] == "live_fenced"}
    assert fenced == {(2, first[2], 0, 0), (3, first[3], 0, 0)}
    assert result["fenced_exit_codes"] == {str(first[2]): FENCED_EXIT, str(first[3]): FENCED_EXIT}
    # they neither reported the failed epoch nor asked to join: the only join requests are the spares'
    assert not [e for e in events if e["kind"] == "live_collective_failed" and e["rank"] in (2, 3)]
    assert sorted(e["rank"] for e in events if e["kind"] == "live_join_wait") == [2, 3]


def test_final_state_is_bitwise_the_fault_free_one_and_no_sample_is_lost_or_repeated(cut_run):
    root, _, _ = cut_run
    whole = whole_final_state(root / "clean", RUN.group_size)
    assert {state["step"].item() for state in whole["optimizer"]["state"].values()} == {RUN.steps}
    assert run_differences(root / "clean", root / "cut", RUN.world) == {}
    assert replica_differences(root / "cut", RUN.world, RUN.group_size) == {}
    assert sample_problems(_events(root / "cut"), RUN.steps, Workload().samples_per_step) == []
