"""Nodes that are really separate hosts: each in its own network, pid, UTS and mount namespace
(``helpers/netns_cluster.py``), driven by ``trainguard train --launcher hosts`` from a head namespace.

Rendezvous, gloo, the supervisor's signals, stack-dump requests and liveness checks all cross the
bridge; a heartbeat's pid names a process of another pid namespace, so nothing works unless it goes
through the node's own agent. A node failure is its link cut (``ip link set tg0 down`` inside it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers.agent_attack import REQUESTS
from helpers.runs import TINY, assert_same_tensors, events, finish_session, ok, start_train, worker_env
from trainguard.runtime.heartbeat import read_heartbeats

AGENT_ATTACK = Path(__file__).parent.parent / "helpers" / "agent_attack.py"
STEPS = 14
HANG_AT = 2  # rank 1 (on n2) hangs in this step, once: stack dumps through the agents, a restart
CUT_AT = 5  # then the link of n2 is cut once every rank has completed this step
STOP_AFTER = 8  # then the supervisor gets a SIGTERM once every rank (n3's too) has completed this step
SLOW_STEPS = "hang:rank=0,step=1,seconds=1,persistent=1"  # ≥ 1 s a step: the cut lands mid-run whatever the load
FAULTS = f"{SLOW_STEPS};hang:rank=1,step={HANG_AT}"
HANG_TIMEOUT = 8
NODE_TIMEOUT = 10  # well above a ping's answer time on a loaded machine
REPLICATED = ["--save-interval", "1000", "--set", "parallel.dp_replicate=2", "--set", "checkpoint.local_interval=1"]


def train_on_hosts(cluster, run: Path, steps: int, *extra: str, faults: str | None = None,
                   during=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``trainguard train --launcher hosts`` in the head namespace; ``during(run, supervisor)`` runs alongside."""
    command = cluster.on_head([
        sys.executable, "-m", "trainguard", "train", "--launcher", "hosts", "--hosts", cluster.hosts(),
        "--node-command", cluster.node_command(), "--nnodes", "2", "--spare-nodes", "1", "--nproc", "1",
        "--node-timeout", str(NODE_TIMEOUT), "--max-restarts", "2", "--run-dir", str(run), "--steps", str(steps),
        *TINY, "--set", f"checkpoint.local_dir={cluster.local}/node{{node}}", *extra])
    env = worker_env(GLOO_SOCKET_IFNAME="tg0", **({"TRAINGUARD_FAULTS": faults} if faults else {}))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    helper = threading.Thread(target=during, args=(run, proc), daemon=True) if during else None
    if helper:
        helper.start()
    done = finish_session(proc, timeout, "the run on hosts")
    if helper:
        helper.join(timeout=5)
    return done


def wait_for_step(run: Path, step: int, ranks: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        beats = read_heartbeats(run)
        if len(beats) == ranks and all(beat.phase in ("step", "save") and beat.step >= step for beat in beats.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run} did not reach step {step} in {timeout:.0f}s")


def attack_agents(cluster, run: Path) -> dict:
    """Issue 40: a client in the head's network namespace, without the run secret, sends every agent of the
    running incarnation stop, the signals and ping, bare, with a forged proof and as garbage
    (``helpers/agent_attack.py``). Returns the answers and the number of requests."""
    incarnations = sorted(run.glob("supervisor/incarnation_*"), key=lambda path: int(path.name.split("_")[1]))
    controls = sorted(str(path) for path in incarnations[-1].glob("*.control"))
    done = subprocess.run(cluster.on_head([sys.executable, str(AGENT_ATTACK), *controls]), capture_output=True,
                          text=True, timeout=60)
    return {"controls": controls, "answers": json.loads(done.stdout), "requests": len(REQUESTS) * len(controls)}


def test_a_hang_then_a_cut_link_across_hosts_ends_bitwise_equal(netns, tmp_path):
    """One run: a hang (stack dumps asked of each node's agent, whose ranks live in another pid
    namespace), then n2's link cut mid-run: detected, n2 excluded, the spare n3 takes its slot and gets
    rank 1's local shards from rank 0 over gloo; then a SIGTERM to the supervisor, passed to the ranks
    through their agents (save, exit 16), and a new supervisor that keeps n2 out finishes the run,
    bitwise equal to a fault-free one."""
    def cut_then_stop(run: Path, supervisor: subprocess.Popen) -> None:
        wait_for_step(run, CUT_AT, ranks=2)
        attacked.update(attack_agents(netns, run))
        netns.cut_link("n2")
        wait_for_step(run, STOP_AFTER, ranks=2)
        supervisor.send_signal(signal.SIGTERM)

    attacked: dict = {}
    reference = tmp_path / "reference"
    # trained while the faulted run sleeps (a bounded fault-free run: it ends by itself if the test fails first)
    training = start_train(reference, 2, STEPS, *REPLICATED)
    run = tmp_path / "cut"
    stopped = train_on_hosts(netns, run, STEPS, *REPLICATED, "--hang-timeout", str(HANG_TIMEOUT), faults=FAULTS,
                             during=cut_then_stop)
    ok(finish_session(training, 300, "the reference run"))
    assert stopped.returncode == 16, stopped.stdout[-6000:]
    # the attack: every request refused (nothing stopped or signalled: the assertions below), one line each
    assert len(attacked["controls"]) == 2 and len(attacked["answers"]) == attacked["requests"], attacked
    assert all(answer and answer["error"].startswith("refused: ") for answer in attacked["answers"]), attacked
    refused = [line for line in stopped.stdout.splitlines() if ": refused request " in line]
    assert len(refused) == attacked["requests"], refused
    assert all(line.startswith(("trainguard agent n1: ", "trainguard agent n2: ")) and " from 10.231.0.254:" in line
               for line in refused), refused
    finished = train_on_hosts(netns, run, STEPS, *REPLICATED)
    assert finished.returncode == 0, finished.stdout[-6000:]

    # the hang: both ranks dumped their stacks on request through their own agent (a heartbeat's pid is
    # a pid of the node's own namespace: here both ranks have the same one)
    (hang,) = events(run, "hang_detected")
    assert hang["ranks_dumped"] == [0, 1] and hang["suspect_ranks"] == [1], hang
    assert "in _hang" in (Path(hang["dumps"]) / "rank_1.txt").read_text()
    # then the cut link: detected as a lost node (its agent stopped answering), not as a hang or a crash
    (lost,) = events(run, "node_lost")
    # (its silence lasts either --node-timeout, or until the ranks' silence has become a hang: whichever is first)
    assert lost["node"] == "n2" and lost["noticed_by"] in ("liveness", "hang"), lost
    assert lost["silent_seconds"] >= (NODE_TIMEOUT if lost["noticed_by"] == "liveness" else 1), lost
    hung, cut_off, stop, last = events(run, "incarnation_ended")
    assert hung["outcome"] == "hang" and hung["nodes"] == ["n1", "n2"], hung
    assert cut_off["outcome"] == "node_lost" and cut_off["failing_node"] == "n2", cut_off
    assert cut_off["nodes"] == ["n1", "n2"] and stop["nodes"] == ["n1", "n3"] == last["nodes"], (stop, last)
    # the stop reached both ranks through their agents: both exited 16 after the save
    assert stop["outcome"] == "stopped" and stop["rank_exit_codes"] == {"0": 16, "1": 16}, stop
    (lifecycle_stop,) = events(run, "lifecycle_stop")
    assert lifecycle_stop["reason"] == "signal" and lifecycle_stop["step"] >= STOP_AFTER, lifecycle_stop
    assert last["outcome"] == "finished" and last["resumed_step"] == lifecycle_stop["step"], last
    # excluded at once, and the spare took its slot
    assert [(e["node"], e["spare"]) for e in events(run, "node_excluded")] == [("n2", "n3")]
    assert [e["node"] for e in events(run, "spare_started")] == ["n3"]
    # each rank ran on its own host (UTS namespace: the node's name)
    hosts = {(e["rank"], e["host"]) for e in events(run, "local_saved")}
    assert hosts == {(0, "n1"), (1, "n2"), (1, "n3")}, hosts
    # the spare's own disk was empty: rank 1's local shards came from rank 0 on n1, over gloo
    (recovery,) = [e for e in events(run, "local_recovery") if e["ranks"]]  # the others found nothing missing
    assert recovery["ranks"] == [1] and recovery["step"] >= CUT_AT and recovery["bytes"] > 0, recovery
    (received,) = events(run, "local_recovered")
    assert received["rank"] == 1 and received["sources"] == [0] and received["host"] == "n3", received
    resumed = events(run, "run_started")[-2]
    assert resumed.get("tier") == "local" and resumed["step"] == recovery["step"], resumed
    # each node's disk holds only its own slot's files; n2's stops where its link was cut
    assert any(netns.disk("n3").glob("node1/global_step_*/model_world_size_2_rank_1.pt"))
    assert not any(netns.disk("n3").glob("node0")) and not any(netns.disk("n1").glob("node1"))
    steps_on_n2 = [int(p.name.split("_")[-1]) for p in netns.disk("n2").glob("node1/global_step_*")]
    assert steps_on_n2 and max(steps_on_n2) == recovery["step"], steps_on_n2
    # bitwise equal to the fault-free run
    assert assert_same_tensors(run / "checkpoints" / f"global_step_{STEPS}",
                               reference / "checkpoints" / f"global_step_{STEPS}") > 0
