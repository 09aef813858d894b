"""The launcher's watch on the processes it starts on other nodes (``live/node_watch.py``, its output relay
``live/node_output.py``), with real node commands (``sh`` standing in for an ``ssh`` that cannot connect)
and a real store: a command that ends before its rank reached the store is the node's failure, named with
its exit code and last line; one whose rank reached the store and then died is a rank's death; one that
exits ssh's 255 after its rank reached the store is dropped while its rank's heartbeat moves, a death when
it does not within the grace. The launcher on network-namespace nodes: tests/integration/test_live_node_lost.py."""

from __future__ import annotations

import secrets
import subprocess
import time
from datetime import timedelta

import torch.distributed as dist

from trainguard.live.node_watch import DROP_GRACE_S, NodeCommandFailed, NodeWatch
from trainguard.live.quorum import beat_key, started_key
from trainguard.live.signed_store import SignedStore, serve_store

REFUSED = "ssh: connect to host 10.0.0.9 port 22: Connection refused"


def _start(watch: NodeWatch, node: str, script: str, rank: int) -> subprocess.Popen:
    command = ["sh", "-c", script]
    return watch.start(node, command, started_key(rank), lambda stderr: subprocess.Popen(command, stderr=stderr),
                       beat_key=beat_key(rank))


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


def test_a_255_after_the_rank_reached_the_store_is_a_drop_while_the_rank_beats_and_a_death_otherwise(tmp_path):
    store = SignedStore(serve_store("127.0.0.1", timedelta(seconds=5)), secrets.token_bytes(32))
    watch = NodeWatch(store, tmp_path / "node_commands")
    lost = "Connection to n1 closed by remote host."
    dropped = _start(watch, "n1", f"echo '{lost}' >&2; exit 255", rank=0)
    dead = _start(watch, "n2", "exit 255", rank=1)
    crashed = _start(watch, "n2", "exit 1", rank=2)
    for rank in range(3):
        store.add(started_key(rank), 1)  # every rank reached the store
    dropped.wait(), dead.wait(), crashed.wait()
    assert watch.failure(dropped) is None and watch.failure(dead) is None
    assert watch.dropped(dropped) is None and watch.dropped(dead) is None  # the grace runs: undecided
    assert watch.dropped(crashed) is False  # a code of the rank's own: its death at once
    store.add(beat_key(0), 1)  # rank 0 beats on after its command ended
    assert watch.dropped(dropped) is True
    time.sleep(DROP_GRACE_S + 0.1)
    assert watch.dropped(dead) is False  # no beat within the grace: the rank died (ssh's 255 for a signal)
    watch.close()
