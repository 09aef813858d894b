"""``--launcher hosts`` without hosts: parsing, the command line a node gets, a lost node's exclusion,
and the agent's control server answering real requests over a real socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from trainguard.errors import ConfigError
from trainguard.run_secret import create_secret, prove_request
from trainguard.runtime.agent_control import ENV_AGENT_CONTROL, AgentControl, ask
from trainguard.runtime.heartbeat import HeartbeatWriter
from trainguard.runtime.hosts import HostNodes, on_node, parse_hosts
from trainguard.runtime.policy import Ended, Outcome, RestartPolicy

SECRET = bytes(range(32))


def test_under_ssh_the_remote_command_is_one_word_quoted_for_the_nodes_shell(tmp_path):
    """``ssh HOST WORDS...`` joins the words with spaces for the remote shell, which splits them again: a
    stand-in ``ssh`` does exactly that (``sh -c "$*"``), so a ``--set`` item with a space or a quote in
    ``TRAINGUARD_SET`` must arrive whole (before: ``x=a`` and ``b`` arrived apart)."""
    ssh = tmp_path / "ssh"
    ssh.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')
    ssh.chmod(0o755)
    sets = json.dumps(["train.seed=3", "x=a b", "y='q'"])
    show = [sys.executable, "-c", "import json, os, sys; print(json.dumps([os.environ['TRAINGUARD_SET'], sys.argv[1:]]))"]
    command = on_node([str(ssh), "{address}"], "n1", "10.0.0.1", [*show, "--set", "x=a b", "--run-dir", "/r d"],
                      {"TRAINGUARD_SET": sets, "OMP_NUM_THREADS": "1"})
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout) == [sets, ["--set", "x=a b", "--run-dir", "/r d"]], done
    assert command[:2] == [str(ssh), "10.0.0.1"] and len(command) == 3
    # a node command that passes its arguments on as they are (ip netns exec, srun, sh -c 'exec "$@"') is not quoted
    assert on_node(["ip", "netns", "exec", "ns-{node}"], "n1", "a", ["p", "x y"], {"A": "a b"}) == [
        "ip", "netns", "exec", "ns-n1", "env", "A=a b", "p", "x y"]


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
        AgentControl(tmp_path, "n1", incarnation=0, secret=SECRET).start(address)
        assert ask(address, "ping", SECRET) == {"ok": True, "node": "n1"}
        assert ask(address, "signal KILL", SECRET)["ok"] is False  # only USR1 and USR2
        assert ask(address, "signal USR1", SECRET) == {"ok": True, "ranks": [0]}
        assert mine.wait(10) == -signal.SIGUSR1
        time.sleep(0.2)
        assert other_node.poll() is None and os.path.exists(f"/proc/{orphan}")
        assert ask(tmp_path / "nowhere.control", "ping", SECRET) is None
    finally:
        for proc in (mine, other_node):
            proc.kill()
            proc.wait()
        os.kill(orphan, signal.SIGKILL)


def _send(address_file, line: bytes) -> dict:
    """A client without the run secret: the bytes as they are, the answer parsed."""
    host, _, port = address_file.read_text().strip().rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(line)
        return json.loads(connection.makefile("r").readline())


RECORDING_RANK = """
import signal, sys, time
for sig in (signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda number, _: print(signal.Signals(number).name[3:], flush=True))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_request_without_the_run_secret_is_refused_and_logged_in_one_line(tmp_path, capfd):
    """Issue 40: anyone who reached an agent's port could signal or stop its ranks. Now every request
    carries a proof of the run secret; without one it does nothing, and the agent says so in one line."""
    rank = subprocess.Popen([sys.executable, "-c", RECORDING_RANK], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"
        _heartbeat(tmp_path, 0, "n1", rank.pid)
        address = tmp_path / "n1.control"
        AgentControl(tmp_path, "n1", incarnation=0, secret=SECRET).start(address)
        proved = prove_request(SECRET, "signal USR2")
        assert _send(address, f"{proved}\n".encode()) == {"ok": True, "ranks": [0]}
        attempts = [b"signal USR1\n", b"stop\n", b"\xff\xfe garbage\n",
                    f"{prove_request(bytes(32), 'stop')}\n".encode(),  # another secret
                    f"{proved}\n".encode()]  # a proof seen on the wire, replayed
        answers = [_send(address, line) for line in attempts]
        assert [answer["ok"] for answer in answers] == [False] * len(attempts)
        assert all(answer["error"].startswith("refused: ") for answer in answers)
        time.sleep(0.2)
        rank.terminate()
        assert rank.stdout.read().split() == ["USR2"], "a request without the secret reached the rank"
        refused = [line for line in capfd.readouterr().err.splitlines() if "refused request" in line]
        assert len(refused) == len(attempts), refused
        assert refused[0] == ("trainguard agent n1: refused request 'signal USR1' from 127.0.0.1:"
                              f"{refused[0].split(':')[-2]}: no proof of the run secret")
        assert refused[-1].endswith("a replayed proof")
    finally:
        rank.kill()
        rank.wait()


def test_a_client_with_the_run_secret_stops_the_agent_and_one_without_cannot(tmp_path):
    """The agent of ``--launcher hosts`` as the supervisor starts it (``serve_from_environment``: its
    secret read from the run directory), in a process of its own."""
    secret = create_secret(tmp_path)
    address = tmp_path / "n1.control"
    agent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom trainguard.runtime.agent_control import serve_from_environment\n"
         "serve_from_environment(sys.argv[1])\ntime.sleep(60)", str(tmp_path)],
        env={**os.environ, ENV_AGENT_CONTROL: str(address), "TRAINGUARD_NODE": "n1"}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not address.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert _send(address, b"stop\n")["ok"] is False
        assert ask(address, "stop", bytes(32)) == {"ok": False, "error": "refused: a bad proof (not made with "
                                                                          "this run's secret)"}
        time.sleep(0.3)
        assert agent.poll() is None, "stopped by a client without the secret"
        assert ask(address, "ping", secret) == {"ok": True, "node": "n1"}
        assert ask(address, "stop", secret) is None  # it ends without answering
        assert agent.wait(10) == 137
        assert agent.stderr.read().count("refused request 'stop'") == 2
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize("answer", [b"[0, 1]\n", b'{"ranks": "pwned"}\n', b'{"ranks": [0, "1", null, true]}\n',
                                    b"[" * 100_000 + b"\n", b"\xff\xfe\n", b"x" * 200_000])
def test_what_answers_at_an_agents_address_is_read_with_bounds(tmp_path, answer):
    """The supervisor reads back what answers at the address in the control file: a listener that is not
    our agent (another process took the port) answers garbage, which is no answer, never a crash."""
    server = socket.create_server(("127.0.0.1", 0))
    control = tmp_path / "n1.control"
    control.write_text(f"127.0.0.1:{server.getsockname()[1]}\n")

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            connection.makefile("rb").readline()
            try:
                connection.sendall(answer)
            except OSError:  # the supervisor stopped reading at its bound
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    nodes = HostNodes({"n1": "127.0.0.1"}, "env")
    nodes.secret, nodes._control["n1"] = SECRET, control
    assert nodes.signal_ranks("n1", None, {}, signal.SIGUSR1) == ([0] if b"ranks" in answer and b"true" in answer else [])
    thread.join(5)
    server.close()
