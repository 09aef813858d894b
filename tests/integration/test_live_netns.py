"""Live recovery (issue 23) across separate hosts: 4 gloo ranks in 2 replica groups x 2, each group on a
node of its own (network namespaces, ``helpers/netns_cluster.py``), two warm spares on a third node, the
store and the lighthouse on the head node. Mid-run the link of group 1's node is really cut (``ip link
set tg0 down`` inside it): its ranks can reach neither their peers nor the store. The survivors find
them silent, carry on alone without restarting, the spares on n3 take their ranks and receive the state
from a live peer on n1; then the cut node's link comes back and its stale ranks, fenced by epoch, stop
instead of rejoining. The end state is bitwise the fault-free run's, every sample used once.

The same as a user starts it (issue 35): ``trainguard run --launcher hosts --hosts ... --node-command ...
--nproc 4 --config user_loop_live.yaml -- python examples/user_loop.py --config user_loop_live.yaml`` (the
example's own YAML plus the live keys, as test_live_user_loop.py makes it) in the head
namespace, no warm spare: the cut node's ranks are replaced cold on the spare node n3."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.netns_cluster import HEAD, NODES
from helpers.runs import events as events_of, trainguard, worker_env
from trainguard.live.compare import replica_differences, run_differences, whole_final_state
from trainguard.live.launcher import LiveRun, launch
from trainguard.live.samples import sample_problems
from trainguard.live.worker import FENCED_EXIT
from trainguard.live.workload import Workload
from test_live_user_loop import live_config

HELPER = Path(__file__).parent.parent / "helpers" / "live_on_nodes.py"
ROOT = Path(__file__).resolve().parents[2]
USER_LOOP = ROOT / "examples" / "user_loop.py"  # the user's example, with its YAML made live (test_live_user_loop)
CUT_AT = 8  # group 1's node loses its link once its rank 2 has committed this step
CUT = "n2"
# long enough after the rejoin (about 10 s) for the stale ranks to come back before the end: their store
# connection resumes at TCP's next retransmission, which backs off while the link is down (seen: 2.7 s
# after the link came back, from a 4 s cut)
RUN = LiveRun(groups=2, group_size=2, steps=100, micro_batch_s=0.05, hang_s=4.0, spares=2, checkpoint_every=0,
              nodes=("n1", CUT, "n3", "n3"))


def _wait(run_dir: Path, what, timeout: float = 90) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in events_of(run_dir) if what(e)]
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
    # fault-free, local, without the simulated compute (a sleep per micro-batch: the same state bit for bit)
    launch(root / "clean", dataclasses.replace(RUN, spares=0, nodes=(), micro_batch_s=0.0))
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
    starts = {(e["rank"], e["pid"], e["rejoin"]) for e in events_of(root / "cut") if e["kind"] == "live_start"}
    assert starts == {(0, first[0], False), (1, first[1], False), (2, first[2], False), (3, first[3], False),
                      (2, last[2], True), (3, last[3], True)}


def test_the_cut_is_found_silent_the_group_leaves_and_rejoins_from_a_live_peer(cut_run):
    root, _, seen = cut_run
    events = events_of(root / "cut")
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
    events = events_of(root / "cut")
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
    assert sample_problems(events_of(root / "cut"), RUN.steps, Workload().samples_per_step) == []


# ------------------------------------------------------------ trainguard run --launcher hosts (issue 35)
USER_STEPS = 40
USER_SETS = [f"train.steps={USER_STEPS}", "fault_tolerance.hang_s=4", "checkpoint.save_interval=10"]


def _user_loop(run_dir: Path, *options: str, sets: tuple[str, ...] = ()) -> list[str]:
    """examples/user_loop.py through ``trainguard run``, its configuration ``user_loop_live.yaml`` beside
    ``run_dir`` (``hosts_run`` writes it)."""
    config = run_dir.parent / "user_loop_live.yaml"
    sets = [arg for item in (*USER_SETS, *sets) for arg in ("--set", item)]
    return ["run", *options, "--nproc", "4", "--config", str(config), "--run-dir", str(run_dir),
            *sets, "--", sys.executable, str(USER_LOOP), "--config", str(config)]


def _on_hosts(netns, run_dir: Path, during, sets: tuple[str, ...] = ()) -> tuple[int, str]:
    """The user loop through ``trainguard run --launcher hosts`` in the head namespace on n1 n2 (+ the spare
    node n3), ``during()`` in a thread beside it; its exit code and output."""
    helper = threading.Thread(target=during, daemon=True)
    helper.start()
    hosts = ",".join(f"{node}={netns.address(node)}" for node in NODES)
    command = [sys.executable, "-m", "trainguard", *_user_loop(
        run_dir, "--launcher", "hosts", "--hosts", hosts, "--node-command", netns.node_command(), sets=sets)]
    code, output = netns.run_on_head(command, worker_env(GLOO_SOCKET_IFNAME="tg0"), run_dir.parent / f"{run_dir.name}.out")
    helper.join(timeout=5)
    return code, output


@pytest.fixture(scope="module")
def hosts_run(netns, tmp_path_factory):
    """n2's link cut once rank 2 committed step CUT_AT and restored once the group left; and the same run
    fault-free, local."""
    root = tmp_path_factory.mktemp("live_hosts")
    live_config(root / "user_loop_live.yaml")
    run_dir, seen = root / "cut", {"head": netns.address(HEAD)}

    def cut_then_restore() -> None:
        _wait(run_dir, lambda e: e["kind"] == "live_step" and e["rank"] == 2 and e["step"] >= CUT_AT, timeout=180)
        netns.cut_link(CUT)
        seen["cut_at"] = time.time()
        _wait(run_dir, lambda e: e["kind"] == "live_quorum" and e["left"])
        netns.restore_link(CUT)

    code, output = _on_hosts(netns, run_dir, cut_then_restore)
    clean = trainguard(*_user_loop(root / "clean"), timeout=240)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return run_dir, root / "clean", code, output, seen


def test_launcher_hosts_starts_each_group_on_its_node_and_replaces_a_cut_node_on_the_spare_node(hosts_run):
    run_dir, _, code, output, seen = hosts_run
    assert code == 0, output[-4000:]
    assert ("live recovery: 2 replica groups of 2 ranks, 0 spares on hosts n1, n2, spare nodes n3, store at "
            f"{seen['head']})") in output, output[-4000:]
    assert f"live run finished: {USER_STEPS} steps in " in output and "ranks replaced: [2, 3]" in output, output[-4000:]
    events = events_of(run_dir)
    (store,) = [e for e in events if e["kind"] == "live_store"]
    assert store["host"] == seen["head"]  # bound to the head's address on the nodes' network
    # every rank ran on its host (UTS namespace: the node's name): the groups on n1 and n2, the cut
    # node's replacements on the spare node n3, cold (no warm spare), started after the cut
    starts = sorted((e["rank"], e["host"], e["rejoin"]) for e in events if e["kind"] == "live_start")
    assert starts == [(0, "n1", False), (1, "n1", False), (2, "n2", False), (2, "n3", True), (3, "n2", False),
                      (3, "n3", True)], starts
    replaced = [e for e in events if e["kind"] == "live_replacement"]
    assert sorted((e["target"], e["node"]) for e in replaced) == [(2, "n3"), (3, "n3")]
    assert all(e["time"] > seen["cut_at"] for e in replaced)
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert quorums[1]["left"] == [2, 3] and quorums[2]["joining"] == [2, 3] and quorums[1]["step"] >= CUT_AT
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}


def test_launcher_hosts_reports_the_cut_node_lost_once(hosts_run):
    """``live_node_lost`` (issue 35): the cut node n2, found hung, once for the node (not once per rank)."""
    run_dir, _, _, _, seen = hosts_run
    lost = [e for e in events_of(run_dir) if e["kind"] == "live_node_lost"]
    assert [(e["node"], e["reason"]) for e in lost] == [(CUT, "hung")], lost
    assert lost[0]["target"] in (2, 3) and lost[0]["time"] > seen["cut_at"]


def test_launcher_hosts_ends_bitwise_equal_to_the_fault_free_run(hosts_run):
    run_dir, clean, _, _, _ = hosts_run
    assert run_differences(clean, run_dir, 4) == {}
    assert replica_differences(run_dir, 4, 2) == {}


def test_launcher_hosts_outlives_its_launchers_death_with_a_restart_from_the_newest_checkpoint(netns, hosts_run):
    """No single point of failure across hosts: the launcher (store, lighthouse) SIGKILLed once step 12 is
    committed; the ranks on n1 and n2 find their lifeline (stdin) or the store gone and exit 18 (their node
    commands, reparented to the command, with them), and the command restarts the run on the hosts from
    global_step_10, bitwise. Before that, the drill kills rank 1 on n1 at step 4: the launcher's SIGKILL
    reaches only its node command (``unshare --fork``: the rank is its child, in a pid namespace of its
    own), and the rank itself ends through its lifeline, at once, replaced on n1 (before: it ran on, out of
    the quorum, until the launcher's death ended it with the others: 5 processes exited 18, checked)."""
    _, clean, _, _, _ = hosts_run
    run_dir = clean.parent / "launcher_lost"

    def kill_the_launcher() -> None:
        _wait(run_dir, lambda e: e["kind"] == "live_step" and e["step"] >= 12, timeout=180)
        # step 10's async save commits in the background while the next steps run
        _wait(run_dir, lambda e: e["kind"] == "checkpoint_committed" and e["step"] == 10, timeout=180)
        (store,) = _wait(run_dir, lambda e: e["kind"] == "live_store")
        os.kill(store["pid"], signal.SIGKILL)

    code, output = _on_hosts(netns, run_dir, kill_the_launcher, sets=("faults=kill:rank=1,step=4",))
    assert code == 0, output[-4000:]
    (kill,) = [e for e in events_of(run_dir) if e["kind"] == "live_kill"]
    assert kill["target"] == 1 and kill["step"] == 4
    replaced = [(e["target"], e["node"]) for e in events_of(run_dir) if e["kind"] == "live_replacement"]
    assert replaced == [(1, "n1")], replaced
    assert not [e for e in events_of(run_dir) if e["kind"] == "live_fenced"]  # the killed rank never came back
    newest = run_dir / "checkpoints" / "global_step_10"
    assert f"restarting the run from {newest}" in output, output[-4000:]
    (lost,) = [e for e in events_of(run_dir) if e["kind"] == "live_launcher_lost"]
    assert list(lost["rank_exit_codes"].values()).count(18) == 4, lost  # each rank's node command: the rank's code
    stores = [e for e in events_of(run_dir) if e["kind"] == "live_store"]
    assert len(stores) == 2 and stores[0]["pid"] != stores[1]["pid"] and stores[1]["host"] == netns.address(HEAD)
    restarted = sorted((e["rank"], e["host"]) for e in events_of(run_dir) if e["kind"] == "live_start"
                       and e["time"] > lost["time"])
    assert restarted == [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")], restarted
    assert run_differences(clean, run_dir, 4) == {}
