"""The side channel of the stall watch's verdict (``live/probe.py``), on real sockets and a real
``TCPStore``: a rank reaches a listening peer, not a closed one, and reports only when the lighthouse
asked; the verdict keeps the most replica groups that all reach each other, never none of them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.live.probe import PeerProbe, interface_address, probe_key, reach_key, reachable_groups, read_reach

MEMBERS = [0, 1, 2, 3]


def group_of(rank: int) -> int:
    return rank // 2


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_rank_reports_the_peers_it_reaches_when_asked(store, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    probes = {rank: PeerProbe(store, rank) for rank in (0, 1, 2)}
    probes[1].close()  # rank 1 behind a cut: refused
    probes[0].report_if_asked(5, [0, 1, 2])
    assert not store.check([reach_key(5, 0)])  # not asked: no probe, no report
    store.set(probe_key(5), "1")
    probes[0].report_if_asked(5, [0, 1, 2])
    probes[1].report_if_asked(5, [0, 1, 2])
    assert json.loads(store.get(reach_key(5, 0))) == [2]
    assert read_reach(store, 5, [0, 1, 2]) == {0: {2}, 1: {0, 2}}


def test_the_interface_address_and_a_bad_interface():
    assert interface_address("lo") == "127.0.0.1" and interface_address("lo,eth9") == "127.0.0.1"
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME='nosuch0'"):
        interface_address("nosuch0")


def _all_but(cut: set[tuple[int, int]]) -> dict[int, set[int]]:
    """Every rank reaching every other, except the (from, to) pairs cut."""
    return {a: {b for b in MEMBERS if b != a and (a, b) not in cut} for a in MEMBERS}


@pytest.mark.parametrize("reach, excluded", [
    (_all_but({(0, 2), (2, 0), (0, 3), (3, 0), (1, 2), (2, 1), (1, 3), (3, 1)}), [1]),  # a cut between the groups
    (_all_but({(0, 1)}), [0]),  # one way inside rank 0's group: group 1 is the whole one
    (_all_but({(3, 0)}), [1]),  # one way between the groups: rank 0's group stays
    (_all_but(set()), [1]),  # no cut seen by the probes: rank 0's group stays, the others leave
    (_all_but({(0, 1), (2, 3)}), []),  # no group whole: no verdict
    ({0: {1, 2, 3}, 1: {0, 2, 3}}, [1]),  # ranks 2 and 3 never reported
])
def test_the_verdict_keeps_the_most_groups_that_reach_each_other(reach, excluded):
    assert reachable_groups(MEMBERS, reach, group_of) == excluded


def test_three_groups_one_cut_off_leaves_alone():
    members = [0, 1, 2, 3, 4, 5]
    cut = {(a, b) for a in (4, 5) for b in (0, 1, 2, 3)} | {(b, a) for a in (4, 5) for b in (0, 1, 2, 3)}
    reach = {a: {b for b in members if b != a and (a, b) not in cut} for a in members}
    assert reachable_groups(members, reach, group_of) == [2]
