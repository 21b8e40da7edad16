"""Fixtures of the control-plane tests: one real in-process replica, or a real cluster of three
replica processes, shared per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shoal.local import LocalCluster, coordinator_specs

from .inprocess import InProcessReplica


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    rep = InProcessReplica(tmp_path_factory.mktemp("replica"))
    try:
        rep.start()
        yield rep
    finally:
        rep.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three coordinator replicas as real processes, stopped even when a test fails."""
    local = LocalCluster(tmp_path_factory.mktemp("run"))
    local.create(coordinator_specs(local.run_dir, 3))
    try:
        local.start_all()
        local.wait_ready()
        yield local
    finally:
        local.stop_all()
