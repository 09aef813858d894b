"""``trainguard train``'s live path across hosts (issue 35, item 4): the reference trainer, 2 replica groups
x 1 rank, under ``--launcher hosts`` on the suite's network-namespace nodes (``helpers/netns_cluster.py``:
each node its own network, pid, UTS and mount namespaces), group 0 on n1, group 1 on n2, a warm spare on
the spare node n3, the store on the head's address. The drill kills rank 1 on n2 after step 3 (through its
lifeline: the launcher's SIGKILL reaches only its node command); the warm spare on n3 takes its place.
Rank 0 keeps its process, and the run ends bitwise equal to the same command run on this machine without
a fault: every rank's final state and the last durable checkpoint."""

from __future__ import annotations

import sys

import pytest

from helpers.netns_cluster import HEAD
from helpers.runs import assert_same_tensors, trainguard, worker_env
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path
from trainguard.live.samples import sample_problems

STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, KILLED = 8, 4, 2, 1
TRAIN = ["--nproc", "2", "--steps", str(STEPS), "--save-interval", "4",
         *[arg for item in ("fault_tolerance.live=true", "parallel.dp_replicate=2", "model.preset=llama-micro",
                            "data.seq_len=32", f"train.micro_batches={MICRO_BATCHES}",
                            f"data.micro_batch_size={MICRO_BATCH_SIZE}") for arg in ("--set", item)]]


@pytest.fixture(scope="module")
def train_on_hosts(netns, tmp_path_factory):
    root = tmp_path_factory.mktemp("live_train_hosts")
    command = [sys.executable, "-m", "trainguard", "train", "--launcher", "hosts", "--hosts", netns.hosts(),
               "--node-command", netns.node_command(), "--run-dir", str(root / "hosts"), *TRAIN,
               "--set", "fault_tolerance.spares=1", "--set", f"faults=kill:rank={KILLED},step=3"]
    code, output = netns.run_on_head(command, worker_env(GLOO_SOCKET_IFNAME="tg0"), root / "hosts.out")
    clean = trainguard("train", "--run-dir", str(root / "clean"), *TRAIN, timeout=300)  # fault-free, this machine
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return root, code, output, netns.address(HEAD)


def test_train_under_launcher_hosts_runs_each_group_on_its_node_and_the_warm_spare_replaces_the_killed_rank(
        train_on_hosts):
    root, code, output, head = train_on_hosts
    assert code == 0, output[-4000:]
    assert (f"live recovery: 2 replica groups of 1 ranks, 1 spares on hosts n1, n2, spare nodes n3, store at {head})"
            in output), output[-4000:]
    assert f"live run finished: {STEPS} steps in " in output and "ranks replaced: [1]" in output, output[-4000:]
    events = list(read_events(events_path(root / "hosts")))
    (store,) = [e for e in events if e["kind"] == "live_store"]
    assert store["host"] == head
    (kill,) = [e for e in events if e["kind"] == "live_kill"]
    assert (kill["target"], kill["step"]) == (KILLED, 3)
    # each process on its node (the UTS name): the groups on n1 and n2, the warm spare, which took rank 1, on
    # n3; rank 0 started once (it kept its process: a restart would start it again)
    starts = sorted((e["rank"], e["host"], e["rejoin"]) for e in events if e["kind"] == "live_start")
    assert starts == [(0, "n1", False), (1, "n2", False), (1, "n3", True)], starts
    assert not [e for e in events if e["kind"] in ("live_replacement", "live_node_lost", "live_fenced")]
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1], [0], [0, 1]]
    assert sample_problems(events, STEPS, MICRO_BATCHES * MICRO_BATCH_SIZE) == []


def test_train_under_launcher_hosts_ends_bitwise_equal_to_the_fault_free_run(train_on_hosts):
    root = train_on_hosts[0]
    assert run_differences(root / "clean", root / "hosts", 2) == {}
    assert replica_differences(root / "hosts", 2, 1) == {}
    last = f"checkpoints/global_step_{STEPS}"
    assert assert_same_tensors(root / "hosts" / last, root / "clean" / last) > 0
