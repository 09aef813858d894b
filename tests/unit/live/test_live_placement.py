"""Where a live run's processes run on separate hosts (``live.placement``), and how the launcher starts
one there: behind the node command, its launcher-given environment on the command line, never the run
secret. The run itself across network-namespace nodes, a node's link cut, is
tests/integration/test_live_netns.py."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import pytest

from trainguard.cli.run import add_parser
from trainguard.cli.train_live import on_nodes
from trainguard.live.launcher import LiveRun, _spawn
from trainguard.live.node_watch import NodeWatch
from trainguard.live.placement import Placement, place, replacement_node
from trainguard.run_secret import ENV_SECRET


def test_groups_take_the_first_hosts_and_warm_spares_the_spare_nodes_round_robin():
    assert place(["a", "b", "c", "d"], groups=2, spares=3) == Placement(("a", "b", "c", "d", "c"), ("c", "d"))
    # no spare node: the warm spares share the groups' nodes
    assert place(["a", "b"], groups=2, spares=2) == Placement(("a", "b", "a", "b"), ())
    with pytest.raises(ValueError, match="1 host\\(s\\) for 2 replica groups"):
        place(["a"], groups=2, spares=0)


def test_a_replacement_starts_home_unless_its_node_is_lost_then_on_a_spare_node_then_the_least_loaded():
    running = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert replacement_node("b", set(), ("c",), running) == "b"  # a process died, its host lives
    assert replacement_node("b", {"b"}, ("c", "d"), running) == "c"
    assert replacement_node("b", {"b", "c"}, ("c", "d"), running) == "d"
    # no spare node left: the live node with the fewest of the run's ranks
    assert replacement_node("b", {"b"}, (), {0: "a", 1: "a", 2: "b", 4: "e"}) == "e"
    assert replacement_node("b", {"a", "b"}, (), {0: "a", 1: "b"}) == "b"  # nowhere else: it waits there


def test_a_node_whose_command_failed_takes_no_replacement_and_none_is_placed_when_only_such_nodes_are_left():
    running = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert replacement_node("b", {"b"}, ("c",), running, frozenset({"b"})) == "c"
    assert replacement_node("b", {"b"}, (), running, frozenset({"b"})) == "a"  # the other live node
    # every node lost: a hung one may come back (the rank waits there), one whose command failed never does
    assert replacement_node("b", {"a", "b"}, (), running, frozenset({"a"})) == "b"
    assert replacement_node("b", {"a", "b"}, (), running, frozenset({"b"})) is None


class _Store:
    port = 29999
    secret = b"s" * 32

    def add(self, key: str, amount: int) -> int:
        return 0


def test_a_rank_on_a_node_starts_behind_the_node_command_with_its_environment_on_the_command_line(tmp_path,
                                                                                                   monkeypatch):
    started = {}

    class Popen:
        pid = 12345

        def __init__(self, command, env, stdin, stderr):
            started.update(command=command, env=env, stdin=stdin)

    monkeypatch.setattr("trainguard.live.launcher.subprocess.Popen", Popen)
    run = LiveRun(nodes=("n1", "n2"), node_command="ssh -T {address} # {node}",
                  node_addresses=(("n1", "10.0.0.1"), ("n2", "10.0.0.2")), store_host="10.0.0.254",
                  rank_env=(("TRAINGUARD_SET", "[]"),), executable="python3", entry=("train.py",))
    watch = NodeWatch(_Store(), tmp_path / "node_commands")
    _spawn(run, 3, _Store(), tmp_path, rejoin=True, node="n2", watch=watch)
    watch.close()
    assert started["command"][:5] == ["ssh", "-T", "10.0.0.2", "#", "n2"]
    assert len(started["command"]) == 6  # ssh: what runs on the node is one word, quoted for its shell
    command = shlex.split(started["command"][5])
    # the node's name as the launcher knows it (TRAINGUARD_NODE): the rank's ``live_start`` and a fault's node=
    assert command[:5] == ["env", "OMP_NUM_THREADS=1", "TRAINGUARD_SET=[]", "TRAINGUARD_NODE=n2", "python3"]
    assert command[5:9] == ["train.py", "--store", "10.0.0.254:29999", "--rank"]
    assert "--lifeline" in command and started["stdin"] == subprocess.PIPE  # the launcher's kill (live/lifeline.py)
    assert not any(ENV_SECRET in word or _Store.secret.hex() in word for word in started["command"])
    assert started["env"][ENV_SECRET] == _Store.secret.hex()  # where the node command passes it on


def test_launcher_hosts_places_the_groups_and_binds_the_store_on_the_nodes_network():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["run", "--launcher", "hosts", "--hosts", "n1=127.0.0.1,n2=127.0.0.1,n3=127.0.0.1",
                              "--node-command", f"{sys.executable} -c pass {{node}}", "--", "python3", "x.py"])
    run = on_nodes(args, LiveRun(groups=2, group_size=2, spares=1))
    assert (run.nodes, run.spare_nodes) == (("n1", "n2", "n3"), ("n3",))
    assert run.node_addresses == (("n1", "127.0.0.1"), ("n2", "127.0.0.1"), ("n3", "127.0.0.1"))
    assert run.store_host == "127.0.0.1"  # the source address of the route to the first node
