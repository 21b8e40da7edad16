"""Fixtures shared by the learner tests: one torch thread in the test process, and a `shoal up`
cluster for the tests that train through one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shoal.cli import main
from shoal.local import LocalCluster

StartCluster = Callable[..., LocalCluster]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny networks run fastest on one thread; two fight each other on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def start_cluster(tmp_path: Path) -> Iterator[StartCluster]:
    """`start_cluster(replicas=, nodes=, timeout=)` runs `shoal up` in tmp_path/cluster; the
    cluster is stopped at teardown, and no process of it may be left, even when the test failed."""
    started: list[LocalCluster] = []

    def start(replicas: int = 1, nodes: int = 1, timeout: int = 60) -> LocalCluster:
        run_dir = tmp_path / "cluster"
        local = LocalCluster(run_dir)
        started.append(local)
        argv = ["up", "--replicas", str(replicas), "--nodes", str(nodes)]
        assert main([*argv, "--timeout", str(timeout), "--run-dir", str(run_dir)]) == 0
        return local

    try:
        yield start
    finally:
        for local in started:
            if (local.run_dir / "cluster.json").exists():
                local.stop_all()
    for local in started:
        assert all(local.pid(s.name) is None for s in local.specs())
