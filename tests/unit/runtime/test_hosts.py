"""``--launcher hosts`` without hosts: parsing, the command line a node gets, a lost node's exclusion,
and the agent's control server answering real requests over a real socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard.errors import ConfigError
from trainguard.runtime.agent_control import AgentControl, ask
from trainguard.runtime.heartbeat import HeartbeatWriter
from trainguard.runtime.hosts import HostNodes, parse_hosts
from trainguard.runtime.policy import Ended, Outcome, RestartPolicy


def test_hosts_parse_in_order_and_bad_lists_are_one_clear_error():
    assert parse_hosts("n1=10.0.0.1,n2=10.0.0.2") == {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    for bad in ("n1", "n1=", "=10.0.0.1", "n1=a,n1=b", "n1=a,,n2=b"):
        with pytest.raises(ConfigError, match="--hosts"):
            parse_hosts(bad)


def test_a_node_gets_its_command_with_the_environment_on_the_command_line():
    nodes = HostNodes({"n1": "10.0.0.1"}, "sh -c 'exec \"$@\"' {node} --address={address}")
    assert nodes.command("n1", ["python", "-m", "x"], {"A": "1"}) == [
        "sh", "-c", 'exec "$@"', "n1", "--address=10.0.0.1", "env", "A=1", "python", "-m", "x"]
    assert nodes.endpoint("n1") != nodes.endpoint("n1")  # a new rendezvous port per incarnation
    for bad in ("sh -c {host}", "no-such-command-here {node}", ""):
        with pytest.raises(ConfigError, match="--node-command"):
            HostNodes({"n1": "a"}, bad)


def test_a_lost_node_is_excluded_at_once_whatever_node_failures_says():
    policy = RestartPolicy(max_restarts=3, crash_loop=2, backoff=0, backoff_max=0, node_failures=5, several_nodes=True)
    lost = Ended(Outcome.NODE_LOST, 1, 4, None, "n2")
    assert policy.node_to_exclude(lost, ["n1", "n2"]).node == "n2"
    assert policy.node_to_exclude(Ended(Outcome.FAILED, 1, 4, 1, "n2"), ["n1", "n2"]) is None


def _heartbeat(run_dir, rank: int, node: str, pid: int) -> None:
    writer = HeartbeatWriter(run_dir, rank)
    writer.record.node, writer.record.pid = node, pid  # as that rank would have written it
    writer.beat("step", 1)


def test_the_agent_signals_only_its_own_nodes_ranks_below_it_and_answers_pings(tmp_path):
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other_node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # a process not below this one (its parent exits at once): a pid that is not one of this agent's ranks
    orphan = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                text=True, check=True).stdout)
    try:
        _heartbeat(tmp_path, 0, "n1", mine.pid)
        _heartbeat(tmp_path, 1, "n2", other_node.pid)
        _heartbeat(tmp_path, 2, "n1", orphan)
        address = tmp_path / "n1.control"
        AgentControl(tmp_path, "n1", incarnation=0).start(address)
        assert ask(address, "ping") == {"ok": True, "node": "n1"}
        assert ask(address, "signal KILL")["ok"] is False  # only USR1 and USR2
        assert ask(address, "signal USR1") == {"ok": True, "ranks": [0]}
        assert mine.wait(10) == -signal.SIGUSR1
        time.sleep(0.2)
        assert other_node.poll() is None and os.path.exists(f"/proc/{orphan}")
        assert ask(tmp_path / "nowhere.control", "ping") is None
    finally:
        for proc in (mine, other_node):
            proc.kill()
            proc.wait()
        os.kill(orphan, signal.SIGKILL)
