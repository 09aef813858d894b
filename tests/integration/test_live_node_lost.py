"""Live recovery on other nodes when a node command itself fails (issue 35, item 4): the launcher tells a
node that cannot start a rank (its node command ends before the rank reached the store: here ``ip netns
exec`` into a network namespace that does not exist, exit 255 at once, as an ``ssh`` that cannot connect)
from a rank's death, marks the node lost (``live_node_lost``) and starts the rank on another node; with
no node left it ends with one line naming the nodes and their commands' errors.

The nodes are the suite's network namespaces (``helpers/netns_cluster.py``); n4 and n5 are names the
fixture never made. Before the fix, rank 1's replacements were started on n4 again, each failing
there, until ``LiveRun.max_replacements``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.netns_cluster import HEAD
from helpers.runs import trainguard, worker_env
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path
from trainguard.live.launcher import LiveRun, launch

HELPER = Path(__file__).parent.parent / "helpers" / "live_on_nodes.py"
ROOT = Path(__file__).resolve().parents[2]
# rank 1's node n4 and the warm spare's node n5 have no namespace; the spare node n3 does
RUN = LiveRun(groups=2, group_size=1, steps=10, micro_batches=4, micro_batch_s=0.0, checkpoint_every=0, hang_s=8.0,
              spares=1, doctor_spares=False, nodes=("n1", "n4", "n5"), spare_nodes=("n3",), timeout_s=150.0)


@pytest.fixture(scope="module")
def lost_node_run(netns, tmp_path_factory):
    root = tmp_path_factory.mktemp("live_node_lost")
    run = dataclasses.replace(RUN, node_command=netns.node_command(), store_host=netns.address(HEAD))
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
    done = subprocess.run(netns.on_head([sys.executable, str(HELPER), str(root / "lost"), str(root / "result.json"),
                                         json.dumps(fields)]),
                          env=worker_env(GLOO_SOCKET_IFNAME="tg0"), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    launch(root / "clean", dataclasses.replace(RUN, spares=0, nodes=(), spare_nodes=()))  # fault-free, local
    return root, json.loads((root / "result.json").read_text()), done.stderr, netns.ns("n4")


def test_a_node_whose_command_fails_is_lost_and_its_rank_starts_on_the_spare_node(lost_node_run):
    root, result, stderr, n4 = lost_node_run
    events = list(read_events(events_path(root / "lost")))
    lost = {e["node"]: e for e in events if e["kind"] == "live_node_lost"}
    missing = "Cannot open network namespace \"{}\": No such file or directory"
    assert sorted(lost) == ["n4", "n5"], lost
    for node, event in lost.items():
        assert (event["reason"], event["exit_code"], event["error"]) == (
            "node_command_failed", 255, missing.format(n4[:-1] + node[-1])), event
    assert lost["n4"]["target"] == 1 and missing.format(n4) in stderr  # the command's own line, relayed
    # the warm spare on n5 never ran: passed over (or, when rank 1's end was seen before the spare's, handed
    # rank 1 and lost with it); rank 1 then started cold on the spare node n3
    excluded = [(e["spare"], e["reason"]) for e in events if e["kind"] == "live_spare_excluded"]
    if lost["n5"].get("spare") == 0:
        assert excluded == [(0, "its node is lost")] and result["replacements"] == {"1": 1}
    else:
        assert lost["n5"]["target"] == 1 and excluded == [] and result["replacements"] == {"1": 2}, lost["n5"]
    assert [(e["target"], e["node"]) for e in events if e["kind"] == "live_replacement"] == [(1, "n3")]
    assert result["exit_codes"] == {"0": 0, "1": 0}
    assert result["first_pids"]["0"] == result["last_pids"]["0"]
    starts = sorted((e["rank"], e["host"], e["rejoin"]) for e in events if e["kind"] == "live_start")
    assert starts == [(0, "n1", False), (1, "n3", True)], starts  # the UTS name: the node it ran on


def test_the_run_whose_node_was_lost_ends_bitwise_equal_to_the_fault_free_run(lost_node_run):
    root = lost_node_run[0]
    assert run_differences(root / "clean", root / "lost", RUN.world) == {}
    assert replica_differences(root / "lost", RUN.world, RUN.group_size) == {}


def test_with_no_node_left_the_run_ends_in_one_line_naming_the_nodes_and_their_commands_errors(tmp_path):
    """Every host's node command fails (a stand-in for ``ssh`` that cannot connect): no rank ever starts, and
    ``trainguard run`` ends at once (exit 1) instead of starting replacements until max_replacements."""
    node_command = ("sh -c 'echo \"ssh: connect to host $0 port 22: Connection refused\" >&2; exit 255' {address}")
    (tmp_path / "live.yaml").write_text("fault_tolerance: {live: true}\nparallel: {dp_replicate: 2}\n"
                                        "train: {steps: 4, micro_batches: 2}\n")
    done = trainguard("run", "--launcher", "hosts", "--hosts", "a=127.0.0.1,b=127.0.0.2", "--node-command", node_command,
                      "--nproc", "2", "--config", str(tmp_path / "live.yaml"), "--run-dir", str(tmp_path / "run"),
                      "--", sys.executable, str(ROOT / "tests" / "helpers" / "live_loop.py"), timeout=120)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("trainguard: error: live run: no node left to start rank "), errors
    for node, address in (("a", "127.0.0.1"), ("b", "127.0.0.2")):
        assert f"{node} (sh exited 255: ssh: connect to host {address} port 22: Connection refused)" in errors[0]
