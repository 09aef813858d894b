"""``LocalNodes.endpoint``: an incarnation's rendezvous port stays reserved for its slot-0 agent, whose
TCPStore binds it later, so two runs on one machine never share it. Real sockets and a real TCPStore; the
two runs' race in a network namespace of its own (``unshare --net``, root) whose kernel hands out only one
or two ports (``ip_local_port_range``), so which port the kernel hands out is no matter of chance."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainguard.runtime.nodes import LocalNodes

SRC = Path(__file__).resolve().parents[3] / "src"
HELPERS = Path(__file__).resolve().parents[2]


def test_the_rendezvous_port_is_refused_to_another_bind_and_still_bound_by_the_runs_store():
    """Before, the port was bound to 0 and closed: anything could bind it until torchrun's store did."""
    nodes = LocalNodes(2)
    port = int(nodes.endpoint("node0").rpartition(":")[2])
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("slot0", "here")
    assert server.get("slot0") == b"here"
    first = nodes.rendezvous_port
    assert int(nodes.endpoint("node0").rpartition(":")[2]) != port  # the next incarnation's: another port
    assert first.fileno() == -1  # the previous one let go


def _race_in_a_namespace(port_range: str) -> list[int | str]:
    """``helpers/rendezvous_ports.py`` in a new network namespace with the ephemeral ports ``port_range``:
    each run's port, or its error."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("a network namespace of its own needs root, unshare and ip")
    script = (f"ip link set lo up && echo '{port_range}' > /proc/sys/net/ipv4/ip_local_port_range && "
              f"exec {sys.executable} -m helpers.rendezvous_ports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HELPERS)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["ports"]


def test_two_runs_taking_their_rendezvous_ports_at_once_get_two_ports():
    """Two ports to hand out: the first run's, held, is never the kernel's pick for the second."""
    assert sorted(_race_in_a_namespace("40000 40001")) == [40000, 40001]


def test_with_one_port_to_hand_out_the_second_run_is_refused_it_not_handed_it_again():
    """Before, both runs were handed 40000, and the second run's torchrun failed to bind its store."""
    assert sorted(_race_in_a_namespace("40000 40000"), key=str) == [40000, "OSError 98"]
