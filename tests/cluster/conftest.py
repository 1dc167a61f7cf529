"""The namespace cluster fixture: three hosts with a 3-member etcd cluster and a Ray
cluster, shared by a module's tests and torn down (and checked gone) after them, also
when a test failed. Skipped with the reason where namespaces cannot be made."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.cluster.netns import NetnsCluster, destroy_prefix, namespaces, unavailable_reason
from tests.cluster.services import ClusterServices, start_services

PREFIX = "phxt"
HOSTS = 3


@pytest.fixture(scope="module")
def multihost(request: pytest.FixtureRequest) -> Iterator[ClusterServices]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host cluster unavailable: {reason}")
    # Ray's unix socket paths must stay short: a private folder directly under /tmp
    workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-", dir="/tmp"))
    destroy_prefix(PREFIX)      # what a killed earlier session left
    failed_before = request.session.testsfailed
    cluster = NetnsCluster(HOSTS, prefix=PREFIX)
    try:
        cluster.create()
        yield start_services(cluster, workdir)
    finally:
        cluster.destroy()
        assert not namespaces(PREFIX), f"namespaces left behind: {namespaces(PREFIX)}"
        if request.session.testsfailed > failed_before:
            # the runs, the launchers' output and Ray's session logs of every host, for
            # whoever reads the failure
            print(f"\nmulti-host test failed: its cluster's files stay in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
