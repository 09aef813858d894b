"""The live store as the run sees it (``live/signed_store.py``), on a real ``TCPStore`` and real sockets:
values sealed with the run secret, a foreign value (another client's, garbage, a value copied from
another key) absent to the run and logged once, counters raised by one process and read by another,
and the launcher's store listening on the address it was given, not on every interface."""

from __future__ import annotations

import logging
import secrets
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.live.signed_store import SignedStore, serve_store

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def launcher_store():
    return SignedStore(serve_store("127.0.0.1", TIMEOUT), secrets.token_bytes(32))


def _client(store: SignedStore, secret: bytes | None = None) -> SignedStore:
    raw = dist.TCPStore(store.host, store.port, is_master=False, timeout=TIMEOUT)
    return SignedStore(raw, store.secret if secret is None else secret)


def test_a_value_written_by_one_process_of_the_run_is_read_by_another(launcher_store):
    rank = _client(launcher_store)
    rank.set("report/0/1", "12")
    assert launcher_store.check(["report/0/1"]) and launcher_store.get("report/0/1") == b"12"
    assert launcher_store.get_int("report/0/1", -1, 100) == 12


def test_a_foreign_value_is_absent_to_the_run_and_logged_once(launcher_store, caplog):
    attacker = dist.TCPStore(launcher_store.host, launcher_store.port, is_master=False, timeout=TIMEOUT)
    attacker.set("stop", "1")
    stranger = _client(launcher_store, secrets.token_bytes(32))  # a store client of another run
    stranger.set("abort/0", "1")
    _client(launcher_store).set("fence/1", "3")
    attacker.set("fence/2", attacker.get("fence/1"))  # a sealed value copied under another key
    with caplog.at_level(logging.WARNING, logger="trainguard.live.store"):
        for _ in range(3):
            assert not launcher_store.check(["stop"]) and not launcher_store.check(["abort/0"])
            assert launcher_store.get_int("fence/2", 0, 100) is None
            assert launcher_store.add("beat/0", 0) == 0
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3, lines
    assert {line.split("'")[1] for line in lines} == {"stop", "abort/0", "fence/2"}
    assert all(line.startswith("trainguard: ignored a foreign value under live store key ") for line in lines)
    with pytest.raises(dist.DistStoreError, match="no valid value under 'stop'"):
        SignedStore(attacker, launcher_store.secret, timedelta(seconds=0.05)).get("stop")


def test_garbage_under_a_counter_is_replaced_by_the_ranks_own_count(launcher_store):
    rank = _client(launcher_store)
    launcher_store.raw.set("beat/3", "pwned")
    assert [rank.add("beat/3", 1) for _ in range(3)] == [1, 2, 3]
    assert launcher_store.add("beat/3", 0) == 3
    replacement = _client(launcher_store)  # a new process of the rank goes on from the count
    assert replacement.add("beat/3", 1) == 4 and launcher_store.add("beat/3", 0) == 4


def test_the_launchers_store_listens_on_its_address_only(launcher_store):
    """Loopback here: 127.0.0.2 is this machine too, but not the address the store was given (a
    ``TCPStore`` made the plain way listens on every interface and accepts it)."""
    socket.create_connection(("127.0.0.1", launcher_store.port), timeout=2).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", launcher_store.port), timeout=2)
