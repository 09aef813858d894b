"""Fixtures of the integration tests that need more than a run directory."""

from __future__ import annotations

import pytest

from helpers.slurm_cluster import Cluster, install_packages


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real Slurm (munged, slurmctld, three slurmd logical nodes n1-n3) shared by the session's tests."""
    why = install_packages()
    if why is not None:
        pytest.skip(f"no Slurm on this machine: {why}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
