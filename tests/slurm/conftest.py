"""One Slurm cluster on loopback (tests/slurm/cluster.py) for every test of this folder: it
takes about ten seconds to start. Tests leave it as they found it (their jobs cancelled,
nodes resumed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import SlurmCluster, missing_tools, running_cluster
from tests.workers.engines import require_engine


@pytest.fixture(scope="session")
def cluster() -> Iterator[SlurmCluster]:
    require_engine(not missing_tools() and os.geteuid() == 0, f"Slurm's daemons as root ({missing_tools()})")
    with running_cluster() as running:
        yield running
