"""The embedded cluster `shoal train` starts when none is up (shoal/local.py): one replica and
one node daemon as real processes, gone with their pid files and ports when the block ends
however it ends, a fresh Raft log each time, and one clear error where a cluster still runs."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from shoal.cli import main
from shoal.local import LocalCluster, LocalClusterError
from shoal.local_embedded import embedded_cluster
from shoal.raft.client import CoordinatorClient

pytestmark = pytest.mark.timeout(120)


def _port_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def _jobs(local: LocalCluster, submit: str | None = None) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        async with CoordinatorClient(local.api_urls(), local.token) as client:
            if submit is not None:
                await client.submit_job(spec={"kind": "test"}, tasks=[], job_id=submit)
            return await client.jobs()

    return asyncio.run(go())


def test_each_start_is_a_fresh_cluster_and_the_end_leaves_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with embedded_cluster(run_dir) as local:
        local.wait_ready(timeout=60)
        assert [n["id"] for n in local.wait_nodes(1, timeout=60)] == ["n1"]
        assert [j["id"] for j in _jobs(local, submit="left-running")] == ["left-running"]
        pids = {s.name: local.pid(s.name) for s in local.specs()}
        urls = local.api_urls()
    assert set(pids) == {"c1", "n1"}
    assert all(pid is not None for pid in pids.values())
    assert all(local.pid(name) is None for name in pids)
    assert list((run_dir / "pids").iterdir()) == []
    assert all(_port_closed(url) for url in urls)

    # The same run directory again: the job the last one left is not brought back.
    with embedded_cluster(run_dir) as again:
        again.wait_ready(timeout=60)
        assert _jobs(again) == []


def test_an_error_inside_the_block_still_stops_the_cluster(tmp_path: Path) -> None:
    started: list[int | None] = []
    clusters: list[LocalCluster] = []

    def fail_inside() -> None:
        with embedded_cluster(tmp_path / "run") as local:
            clusters.append(local)
            started.extend(local.pid(s.name) for s in local.specs())
            raise RuntimeError("the caller failed")

    with pytest.raises(RuntimeError, match="the caller failed"):
        fail_inside()
    assert len(started) == 2
    assert all(pid is not None for pid in started)
    assert all(clusters[0].pid(s.name) is None for s in clusters[0].specs())


def test_a_run_directory_whose_cluster_still_runs_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "busy"
    local = LocalCluster(run_dir)
    try:
        assert main(["up", "--replicas", "1", "--run-dir", str(run_dir), "--timeout", "60"]) == 0
        capsys.readouterr()
        with pytest.raises(LocalClusterError, match="already running"), embedded_cluster(run_dir):
            pass
        argv = ["train", "cartpole", "--embedded", "--run-dir", str(run_dir), "--quiet"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert "the embedded cluster did not start" in err
        assert "`shoal down` first" in err
        assert local.pid("c1") is not None  # someone else's cluster is left alone
    finally:
        local.stop_all()
