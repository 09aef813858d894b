"""The launcher's watch on the processes it starts on other nodes (``live/node_watch.py``, its output relay
``live/node_output.py``), with real node commands (``sh`` standing in for an ``ssh`` that cannot connect)
and a real store: a command that ends before its rank reached the store is the node's failure, named with
its exit code and last line; one whose rank reached the store and then died is a rank's death. The
launcher on network-namespace nodes: tests/integration/test_live_node_lost.py."""

from __future__ import annotations

import secrets
import subprocess
import time
from datetime import timedelta

import torch.distributed as dist

from trainguard.live.node_watch import NodeCommandFailed, NodeWatch
from trainguard.live.quorum import started_key
from trainguard.live.signed_store import SignedStore, serve_store

REFUSED = "ssh: connect to host 10.0.0.9 port 22: Connection refused"


def _start(watch: NodeWatch, node: str, script: str, rank: int) -> subprocess.Popen:
    command = ["sh", "-c", script]
    return watch.start(node, command, started_key(rank), lambda stderr: subprocess.Popen(command, stderr=stderr))


def test_a_node_command_that_ends_before_its_rank_reached_the_store_is_the_nodes_failure(tmp_path, capfd):
    store = SignedStore(serve_store("127.0.0.1", timedelta(seconds=5)), secrets.token_bytes(32))
    rank_side = SignedStore(dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=5)),
                            store.secret)
    watch = NodeWatch(store, tmp_path / "node_commands")
    unreachable = _start(watch, "n2", f"echo 'warning: a first line' >&2; echo '{REFUSED}' >&2; exit 255", rank=2)
    died = _start(watch, "n1", "echo 'Traceback: the rank crashed' >&2; sleep 0.5; exit 1", rank=1)
    rank_side.add(started_key(1), 1)  # rank 1's process reached the store, then died
    running = _start(watch, "n1", "sleep 30", rank=0)
    unreachable.wait(), died.wait()
    assert watch.failure(unreachable) == NodeCommandFailed("n2", "sh", 255, REFUSED)
    assert watch.failure(unreachable).describe() == f"sh exited 255: {REFUSED}"
    assert watch.failure(died) is None  # a rank's death: replaced on its node as before
    assert watch.failure(running) is None
    running.kill()
    running.wait()
    # a rank of the same number started again counts from its predecessors' starts
    again = _start(watch, "n1", "exit 3", rank=1)
    again.wait()
    assert watch.failure(again) == NodeCommandFailed("n1", "sh", 3, "")
    time.sleep(0.3)  # the relay's next look
    watch.close()
    relayed = capfd.readouterr().err  # every line reached the launcher's own standard error
    assert "warning: a first line" in relayed and REFUSED in relayed and "Traceback: the rank crashed" in relayed
