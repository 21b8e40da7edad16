"""`shoal train` on a real 3-replica local cluster survives kill -9 of a follower and then of
the leader (each restarted at once, so it replays its log while the run asks it for the job):
the run reads its job through a consistent read and a lone bad answer never ends it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient
from tests.support.processes import child_process, eventually_while_running

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture
def cluster(start_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return start_cluster(replicas=3, timeout=90)


def _leader(local: LocalCluster) -> str:
    async def ask() -> str:
        async with CoordinatorClient(local.api_urls(), local.token, timeout=30) as c:
            return await c.find_leader()

    url = asyncio.run(ask())
    return next(s.name for s in local.specs() if s.api_url == url)


def _steps(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "status-0.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _kill_and_restart(local: LocalCluster, name: str) -> None:
    local.kill(name)
    local.start(name)


def test_a_run_goes_on_through_a_killed_follower_and_a_killed_leader(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", "cartpole", "--cluster", str(cluster.run_dir),
        "--run-dir", str(run_dir), "--workers", "1", "--time-limit", "200",
        "--target-return", "100000", "--quiet", "--json", "--no-eval",
    ]  # fmt: skip
    with child_process(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        eventually_while_running(proc, lambda: _steps(run_dir) > 0, "training steps", 150)
        first = next(s.name for s in cluster.specs() if s.api_url == cluster.api_urls()[0])
        others = [s.name for s in cluster.specs() if s.api_url and s.name != first]
        # The run asks the first replica first. Killed and restarted while the other two are
        # paused, it answers from whatever it has replayed alone and no consistent read can
        # pass; the run must wait until the others are back.
        for name in others:
            cluster.signal(name, signal.SIGSTOP)
        try:
            _kill_and_restart(cluster, first)
            time.sleep(10.0)
        finally:
            for name in others:
                cluster.signal(name, signal.SIGCONT)
        time.sleep(2.0)
        leader = _leader(cluster)
        if leader != first:
            _kill_and_restart(cluster, first)  # a follower
            time.sleep(1.0)
        _kill_and_restart(cluster, _leader(cluster))
        before = _steps(run_dir)
        eventually_while_running(
            proc, lambda: _steps(run_dir) > before + 2, "training past the kills", 60
        )
        time.sleep(3.0)  # several more job checks, some against the replaying replicas
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 1), err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == "interrupted"
    assert summary["env_steps"] > 0
