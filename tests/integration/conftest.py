"""Fixtures of the integration tests that need more than a run directory."""

from __future__ import annotations

import pytest

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
