"""Fixtures of the integration tests that need more than a run directory."""

from __future__ import annotations

import pytest

from helpers.live_fsdp import StartedRun, start_clean
from helpers.netns_cluster import NetnsCluster, unavailable
from helpers.slurm_cluster import Cluster, install_packages


def running(cluster, why_not: str | None, what: str):
    """Starts ``cluster`` for the fixture's scope and stops it afterwards, even after a failed start."""
    if why_not is not None:
        pytest.skip(f"no {what} on this machine: {why_not}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real Slurm (munged, slurmctld, eight slurmd logical nodes n1-n8) shared by the session's tests."""
    yield from running(Cluster(tmp_path_factory.mktemp("slurm")), install_packages(), "Slurm")


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    """Four hosts on one bridge: a head namespace for the supervisor and nodes n1-n3, each in network,
    pid, UTS and mount namespaces of its own (``helpers/netns_cluster.py``); deleted afterwards."""
    yield from running(NetnsCluster(tmp_path_factory.mktemp("netns")), unavailable(), "network namespaces")


@pytest.fixture(scope="session")
def live_fsdp_clean(tmp_path_factory) -> StartedRun:
    """The fault-free live FSDP2 run (``helpers/live_fsdp.py``'s ``CLEAN``) that test_live_fsdp.py and
    test_live_fsdp_sdc.py compare with: started when first asked for, beside the asking module's own runs,
    and waited for by whichever test reads it first (``.finished()``)."""
    run = start_clean(tmp_path_factory.mktemp("live_fsdp_clean"))
    yield run
    run.wait()  # read by then, unless the module that asked failed first: ended before its directory goes
