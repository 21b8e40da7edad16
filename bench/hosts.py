"""`shoal bench hosts`: how fast a learner group trains again after it lost its host.

A `shoal up --hosts 2` cluster (network namespaces, TLS, checkpoints in the cluster's storage,
the coordinators' default liveness: a node is dead 10 s after its last heartbeat) runs
CartPole-v1 with 2 learner ranks (one NVLink island of 2 simulated GPUs: one host) and
checkpoints every second. Once rank 0 published a checkpoint, every process on the ranks'
host gets SIGKILL; measured: seconds until rank 0 publishes a policy version past the
resumed checkpoint from the other host. Beside it, in the same run on the same cluster: rank
0's process alone SIGKILLed (the node sees the exit at once and the leader restarts the group
where it was), the same measurement. The difference is what losing a whole host costs:
detecting it (the liveness timeout) and nothing else. Needs root (else no rows).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal.bench.report import Row

POLL_S = 0.1
PATIENT_S = 300.0


def _job(local: Any) -> dict[str, Any] | None:
    from shoal.raft.client import CoordinatorClient
    from shoal.runtime.tls import TlsFiles

    tls = TlsFiles(local.tls_dir)

    async def go() -> dict[str, Any] | None:
        async with CoordinatorClient(
            local.api_urls(), local.token, timeout=10.0, tls=tls
        ) as client:
            jobs = (await client.request("GET", "/v1/jobs"))["jobs"]
            running = [j for j in jobs if j.get("state") == "running"]
            return dict(await client.job(running[0]["id"])) if running else None

    return asyncio.run(go())


def _rank0(local: Any) -> dict[str, Any]:
    job = _job(local) or {}
    return next((t for t in job.get("tasks", []) if t["id"].endswith("-learner-0")), {})


def _wait(what: str, check: Any) -> Any:
    deadline = time.monotonic() + PATIENT_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} did not happen within {PATIENT_S:g} s")


def _kill_host(local: Any, node: str) -> None:
    from shoal import hosts

    for pid in hosts.pids(local.network(), node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_rank0(local: Any, node: str) -> None:
    task_dirs = (local.run_dir / "data" / node / "jobs").glob("*/tasks/*learner-0*")
    wanted = {str(d) for d in task_dirs}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        task_dir = next(
            (e[15:].decode() for e in environ if e.startswith(b"SHOAL_TASK_DIR=")), None
        )
        if task_dir in wanted:
            os.kill(int(proc.name), signal.SIGKILL)


def _recovery(local: Any, kill: str) -> float:
    """Seconds from the kill until rank 0 trains past its resumed checkpoint again."""
    published = _wait(
        "a checkpoint", lambda: (_rank0(local).get("published") or {}).get("checkpoint_step")
    )
    before = _rank0(local)
    node, generation = before["node"], before["generation"]
    if kill == "host":
        killed_at = time.monotonic()
        _kill_host(local, node)
    else:
        killed_at = time.monotonic()
        _kill_rank0(local, node)

    def trains_again() -> bool:
        now = _rank0(local)
        step = (now.get("published") or {}).get("version", 0)
        return now.get("generation", 0) > generation and step > published

    _wait("training again", trains_again)
    return time.monotonic() - killed_at


def _start_train(local: Any, run_dir: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SHOAL_TLS_DIR": str(local.run_dir / "tls")}
    return subprocess.Popen(
        [sys.executable, "-m", "shoal", "train", "cartpole", "--ranks", "2", "--workers", "2",
         "--gpus-per-rank", "1", "--checkpoint-interval", "1", "--target-return", "1e9",
         "--time-limit", str(PATIENT_S * 2), "--no-eval", "--quiet",
         "--cluster", str(local.run_dir), "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(quick: bool) -> list[Row]:
    from shoal import hosts
    from shoal.errors import ShoalError
    from shoal.local import LocalCluster
    from shoal.local_hosts import create_hosts_cluster

    try:
        hosts.check_can_create()
    except ShoalError:
        return []
    root = Path(tempfile.mkdtemp(prefix="shoal-bench-hosts-"))
    local = LocalCluster(root / "cluster")
    try:
        create_hosts_cluster(local, 2, 1, sim_gpus=2, island_size=2)
        local.start_all()
        local.wait_ready(timeout=120)
        local.wait_nodes(2, timeout=120)
        proc = _start_train(local, root / "train")
        try:
            process_s = _recovery(local, "rank0")
            host_s = _recovery(local, "host")
        finally:
            _stop(proc)
    finally:
        local.stop_all()
        local.remove_network()
        shutil.rmtree(root, ignore_errors=True)
    return [
        Row(
            "learner group's host killed: training again on the other host",
            "s",
            host_s,
            process_s,
            "rank 0's process killed (restarted in place)",
            higher_is_better=False,
        )
    ]
