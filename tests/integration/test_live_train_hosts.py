"""``trainguard train``'s live path on other nodes (issue 35, item 4): the reference trainer, 2 replica groups
x 1 rank, a warm spare on the spare node, the drill killing rank 1 after step 3, under both launchers:

- ``--launcher hosts`` on the suite's network-namespace nodes (``helpers/netns_cluster.py``: each node its
  own network, pid, UTS and mount namespaces): group 0 on n1, group 1 on n2, the spare on n3, the store on
  the head's address; the drill's kill reaches rank 1 through its lifeline (the launcher's SIGKILL reaches
  only its node command);
- ``--launcher slurm`` in a batch job of 3 nodes of the suite's real Slurm, each process a job step.

The warm spare takes rank 1's place, rank 0 keeps its process, and each run ends bitwise equal to the same
command run on this machine without a fault (one twin for both): every rank's final state and the last
durable checkpoint. The three runs start together (one module fixture), each test waiting for its own."""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.netns_cluster import HEAD
from helpers.runs import assert_same_tensors, trainguard, worker_env
from helpers.warm_command import warm_server
from trainguard.events.log import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path
from trainguard.live.samples import sample_problems
from test_live_slurm import live_batch_job

STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, KILLED = 8, 4, 2, 1
# the heartbeat timeout is long: the three runs' ranks and spares starting together on a small machine can be
# silent for longer than the default 10 s (no run drills a hang: the killed rank is seen by its exit)
TRAIN = ["--nproc", "2", "--steps", str(STEPS), "--save-interval", "4",
         *[arg for item in ("fault_tolerance.live=true", "parallel.dp_replicate=2", "model.preset=llama-micro",
                            "data.seq_len=32", f"train.micro_batches={MICRO_BATCHES}",
                            f"data.micro_batch_size={MICRO_BATCH_SIZE}", "fault_tolerance.hang_s=60")
           for arg in ("--set", item)]]
FAULTED = ["--set", "fault_tolerance.spares=1", "--set", f"faults=kill:rank={KILLED},step=3"]


def _clean(run_dir: Path) -> Path:
    """The fault-free twin, on this machine."""
    clean = trainguard("train", "--run-dir", str(run_dir), *TRAIN, timeout=300)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return run_dir


def _on_hosts(netns, root: Path):
    command = [sys.executable, "-m", "trainguard", "train", "--launcher", "hosts", "--hosts", netns.hosts(),
               "--node-command", netns.node_command(), "--run-dir", str(root / "hosts"), *TRAIN, *FAULTED]
    code, output = netns.run_on_head(command, worker_env(GLOO_SOCKET_IFNAME="tg0"), root / "hosts.out")
    return root, code, output, netns.address(HEAD)


def _under_slurm(slurm, tmp_path: Path) -> tuple[Path, str, dict[int, str | None]]:
    run_dir = tmp_path / "slurm_run"
    output, nodes = live_batch_job(slurm, tmp_path, run_dir, ["train", "--launcher", "slurm", "--run-dir", str(run_dir),
                                                                *TRAIN, *FAULTED])
    return run_dir, output, nodes


@pytest.fixture(scope="module")
def launched(netns, request, tmp_path_factory) -> dict[str, Future | str]:
    """The fault-free twin and the runs under both launchers, started at once in threads of their own, each in a
    directory of its own; each test waits for its own. Where Slurm cannot run here, ``"slurm"`` holds why (its
    test is skipped, the others run)."""
    try:
        slurm = request.getfixturevalue("slurm")
    except pytest.skip.Exception as no_slurm:
        slurm = str(no_slurm)
    root = tmp_path_factory.mktemp("live_train")
    for name in ("clean", "hosts", "slurm"):
        (root / name).mkdir()
    warm_server()  # the session's server made here, not by a thread
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {"clean": pool.submit(_clean, root / "clean" / "clean"), "hosts": pool.submit(_on_hosts, netns, root / "hosts"),
               "slurm": slurm if isinstance(slurm, str) else pool.submit(_under_slurm, slurm, root / "slurm")}


@pytest.fixture(scope="module")
def clean_train(launched) -> Path:
    return launched["clean"].result()


@pytest.fixture(scope="module")
def train_on_hosts(launched):
    return launched["hosts"].result()


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


def test_train_under_launcher_hosts_ends_bitwise_equal_to_the_fault_free_run(train_on_hosts, clean_train):
    _assert_bitwise(train_on_hosts[0] / "hosts", clean_train)


def _assert_bitwise(run_dir: Path, clean: Path) -> None:
    assert run_differences(clean, run_dir, 2) == {}
    assert replica_differences(run_dir, 2, 1) == {}
    last = f"checkpoints/global_step_{STEPS}"
    assert assert_same_tensors(run_dir / last, clean / last) > 0


def test_train_under_launcher_slurm_replaces_the_killed_rank_with_the_warm_spare_and_ends_bitwise(launched, clean_train):
    if isinstance(launched["slurm"], str):
        pytest.skip(launched["slurm"])
    run_dir, output, nodes = launched["slurm"].result()
    assert f"live run finished: {STEPS} steps in " in output and f"ranks replaced: [{KILLED}]" in output, output[-4000:]
    groups, spare_nodes = output.split("on hosts ", 1)[1].split(", store at", 1)[0].split(", spare nodes ")
    events = list(read_events(events_path(run_dir)))
    # each process a job step on its node: the groups' first two, the warm spare (rank 1's now) on the third
    starts = sorted((e["rank"], nodes.get(e["pid"]), e["rejoin"]) for e in events if e["kind"] == "live_start")
    assert starts == [(0, groups.split(", ")[0], False), (1, groups.split(", ")[1], False),
                      (1, spare_nodes, True)], (starts, output[-2000:])
    assert not [e for e in events if e["kind"] in ("live_replacement", "live_node_lost")]
    assert [q["members"] for q in events if q["kind"] == "live_quorum"] == [[0, 1], [0], [0, 1]]
    _assert_bitwise(run_dir, clean_train)
