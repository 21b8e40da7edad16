"""`shoal bench raft`: the control plane under load, beside raw pysyncobj measured in the same run.

- sequential write latency (p50/p99) through the client and through plain HTTP, beside a raw
  pysyncobj replicated call on a 3-process cluster with the same timings and encryption; and on
  a 1-replica coordinator beside a raw pysyncobj node without peers (same timings);
- concurrent writes/s through the client's batching path and through plain HTTP, beside raw
  pysyncobj with its own append batching;
- leader failover (kill -9 -> first write committed through the API) with shoal's timings,
  beside pysyncobj's default timings;
- 512 simulated nodes heartbeating at 1 Hz: leader CPU, heartbeat p99 and dead-node detection.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from pysyncobj import SyncObj, SyncObjConf, replicated

from shoal.bench.report import Row
from shoal.local import LocalCluster, coordinator_specs
from shoal.ports import free_port
from shoal.raft.batcher import CommandBatcher
from shoal.raft.client import CoordinatorClient
from shoal.raft.pysyncobj_seam import is_leader

PYSYNCOBJ_DEFAULT_TIMINGS = (
    "--min-election-timeout",
    "0.4",
    "--max-election-timeout",
    "1.4",
    "--append-period",
    "0.1",
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- raw pysyncobj baseline -------------------------------------------------------------------


class _Counter(SyncObj):
    def __init__(self, me: str, peers: list[str], conf: SyncObjConf) -> None:
        super().__init__(me, peers, conf)
        self.value = 0

    @replicated
    def incr(self, n: int) -> int:
        self.value += n
        return self.value


RAW_SECRET_ENV = "SHOAL_BENCH_RAW_SECRET"
"""The baseline encrypts like shoal does, with a secret made for the run (a fixed one would let
anyone who reaches its ports send pickles); its follower processes inherit it here."""


def _ensure_raw_secret() -> None:
    os.environ.setdefault(RAW_SECRET_ENV, secrets.token_urlsafe(32))


def _raw_conf(me: str, batch: bool, min_timeout: float) -> SyncObjConf:
    return SyncObjConf(
        password=os.environ[RAW_SECRET_ENV], bindAddress=me,
        appendEntriesUseBatch=batch, appendEntriesPeriod=0.05, raftMinTimeout=min_timeout,
        raftMaxTimeout=min_timeout + 0.15, connectionTimeout=max(1.0, min_timeout + 0.2), connectionRetryTime=0.2,
    )  # fmt: skip


def raw_follower(me: str, peers: str, batch: str) -> None:
    """Entry point of a raw pysyncobj follower process (slow elections so the bench leads)."""
    node = _Counter(me, peers.split(","), _raw_conf(me, batch == "1", 5.0))
    sys.stdin.read()  # until the parent closes our stdin
    node.destroy()


@contextmanager
def _raw_cluster(batch: bool) -> Iterator[_Counter]:
    _ensure_raw_secret()
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    procs = []
    code = "import sys; from shoal.bench.raft import raw_follower; raw_follower(*sys.argv[1:])"
    for i in (1, 2):
        peers = ",".join(a for j, a in enumerate(addrs) if j != i)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, addrs[i], peers, "1" if batch else "0"],
                stdin=subprocess.PIPE,
            )
        )
    node = _Counter(addrs[0], addrs[1:], _raw_conf(addrs[0], batch, 0.2))
    try:
        deadline = time.monotonic() + 30
        while not is_leader(node):
            if time.monotonic() > deadline:
                raise TimeoutError("raw pysyncobj elected no leader")
            time.sleep(0.02)
        yield node
    finally:
        node.destroy()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def _raw_alone() -> Iterator[_Counter]:
    """A raw pysyncobj node without peers: it leads itself after one election timeout."""
    _ensure_raw_secret()
    me = f"127.0.0.1:{free_port()}"
    node = _Counter(me, [], _raw_conf(me, False, 0.2))
    try:
        deadline = time.monotonic() + 30
        while not is_leader(node):
            if time.monotonic() > deadline:
                raise TimeoutError("raw pysyncobj without peers never led")
            time.sleep(0.02)
        yield node
    finally:
        node.destroy()


def _setter(event: threading.Event) -> Any:
    return lambda result, err: event.set()


def _raw_sequential(node: _Counter, n: int) -> list[float]:
    out = []
    for _ in range(n):
        done = threading.Event()
        start = time.perf_counter()
        node.incr(1, callback=_setter(done))
        done.wait(5)
        out.append(time.perf_counter() - start)
    return out


def _raw_concurrent(node: _Counter, n: int) -> float:
    done = threading.Event()
    left = [n]
    lock = threading.Lock()

    def callback(result: Any, err: int) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    start = time.perf_counter()
    for _ in range(n):
        node.incr(1, callback=callback)
    done.wait(60)
    return n / (time.perf_counter() - start)


# -- shoal cluster --------------------------------------------------------------------------------


@contextmanager
def _cluster(extra: tuple[str, ...] = (), replicas: int = 3) -> Iterator[LocalCluster]:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-raft-") as tmp:
        local = LocalCluster(Path(tmp))
        local.create(coordinator_specs(local.run_dir, replicas, extra))
        try:
            local.start_all()
            local.wait_ready()
            yield local
        finally:
            local.stop_all()


async def _sequential(local: LocalCluster, n: int) -> tuple[list[float], list[float]]:
    leader = local.wait_ready()
    via_client, via_http = [], []
    async with CoordinatorClient([leader], local.token) as client:
        for i in range(n):
            start = time.perf_counter()
            await client.add_event("bench", str(i))
            via_client.append(time.perf_counter() - start)
    headers = {"Authorization": f"Bearer {local.token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for i in range(n):
            start = time.perf_counter()
            async with session.post(
                f"{leader}/v1/events", json={"kind": "bench", "message": str(i)}
            ) as resp:
                await resp.read()
                assert resp.status == 201
            via_http.append(time.perf_counter() - start)
    return via_client, via_http


async def _concurrent_client(local: LocalCluster, n: int) -> float:
    async with CoordinatorClient([local.wait_ready()], local.token) as client:
        batcher = CommandBatcher(client)
        start = time.perf_counter()
        await asyncio.gather(
            *(batcher.submit("add_event", {"kind": "bench", "message": "c"}) for _ in range(n))
        )
        return n / (time.perf_counter() - start)


async def _concurrent_http(local: LocalCluster, n: int, in_flight: int = 64) -> float:
    leader = local.wait_ready()
    headers = {"Authorization": f"Bearer {local.token}"}
    slots = asyncio.Semaphore(in_flight)
    async with aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=in_flight)
    ) as session:

        async def one() -> None:
            async with (
                slots,
                session.post(f"{leader}/v1/events", json={"kind": "bench", "message": "h"}) as resp,
            ):
                await resp.read()

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - start)


def _leader_name(local: LocalCluster) -> str:
    url = local.wait_ready()
    return next(s.name for s in local.specs() if s.api_url == url)


async def _failovers(local: LocalCluster, kills: int) -> list[float]:
    times = []
    for i in range(kills):
        victim = _leader_name(local)
        async with CoordinatorClient(
            local.api_urls(), local.token, timeout=20, request_timeout=1.0
        ) as client:
            await client.add_event("bench", f"warm-{i}")
            local.kill(victim)
            killed = time.perf_counter()
            await client.add_event("bench", f"after-kill-{i}")
            times.append(time.perf_counter() - killed)
        local.start(victim)
        _wait_converged(local)
    return times


def _wait_converged(local: LocalCluster, timeout: float = 30.0) -> None:
    """Until every replica is up, in one term and caught up: the next kill starts from calm."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        local.wait_ready()
        views = [local.cluster_view(s.name) for s in local.specs()]
        if all(views) and len({(v["term"], v["last_applied"]) for v in views if v}) == 1:
            return
        time.sleep(0.05)
    raise TimeoutError("replicas did not converge after a restart")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _watch_until_dead(session: aiohttp.ClientSession, url: str, since: float) -> float:
    """Seconds from `since` (the node's last heartbeat) until the API shows it dead."""
    while True:
        async with session.get(url) as resp:
            if (await resp.json())["liveness"] == "dead":
                return time.monotonic() - since
        await asyncio.sleep(0.02)


async def _heartbeats(local: LocalCluster, nodes: int, seconds: float) -> dict[str, float]:
    leader = local.wait_ready()
    pid = local.pid(_leader_name(local))
    assert pid is not None
    async with CoordinatorClient([leader], local.token) as client:
        for start in range(0, nodes, 256):
            await client.batch([
                {"op": "register_node", "args": {"node_id": f"sim{i}", "address": "127.0.0.1:1", "resources": {"cpus": 8, "memory": 1 << 30}}}
                for i in range(start, min(nodes, start + 256))
            ])  # fmt: skip
    idle_before = _cpu_seconds(pid)
    await asyncio.sleep(seconds)
    idle_cpu = (_cpu_seconds(pid) - idle_before) / seconds
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    silent = "sim0"  # falls silent halfway; the others keep beating
    detection: list[asyncio.Task[float]] = []
    headers = {"Authorization": f"Bearer {local.token}"}
    async with aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=128)
    ) as session:

        async def node(i: int) -> None:
            node_id = f"sim{i}"
            await asyncio.sleep(i / nodes)
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                async with session.post(
                    f"{leader}/v1/nodes/{node_id}/heartbeat", json={"health": {"gpu_util": 0.5}}
                ) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - started)
                if node_id == silent and time.monotonic() > stop_at - seconds / 2:
                    watch = _watch_until_dead(
                        session, f"{leader}/v1/nodes/{silent}", time.monotonic()
                    )
                    detection.append(asyncio.get_running_loop().create_task(watch))
                    return
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))

        busy_before = _cpu_seconds(pid)
        await asyncio.gather(*(node(i) for i in range(nodes)))
        busy_cpu = (_cpu_seconds(pid) - busy_before) / seconds
        detected = await detection[0]
    return {
        "idle_cpu": idle_cpu * 100,
        "busy_cpu": busy_cpu * 100,
        "p99": _pct(latencies, 0.99) * 1000,
        "p50": _pct(latencies, 0.5) * 1000,
        "detected": detected,
    }


def run(quick: bool) -> list[Row]:
    seq_n, conc_n, kills, hb_seconds = (50, 2000, 3, 3.0) if quick else (500, 20000, 10, 10.0)
    rows: list[Row] = []
    with _raw_cluster(batch=False) as raw:
        raw_seq = _raw_sequential(raw, seq_n)
    with _raw_cluster(batch=True) as raw:
        raw_conc = _raw_concurrent(raw, conc_n)
    with _raw_alone() as alone:
        raw_alone = _raw_sequential(alone, seq_n)
    with _cluster(replicas=1) as one:
        one_client, _ = asyncio.run(_sequential(one, seq_n))
    with _cluster(("--suspect-after", "1", "--dead-after", "2")) as local:
        via_client, via_http = asyncio.run(_sequential(local, seq_n))
        conc_client = asyncio.run(_concurrent_client(local, conc_n))
        conc_http = asyncio.run(_concurrent_http(local, min(conc_n, 5000)))
        hb = asyncio.run(_heartbeats(local, 512, hb_seconds))
        failover = asyncio.run(_failovers(local, kills))
    with _cluster(PYSYNCOBJ_DEFAULT_TIMINGS) as slow:
        failover_default = asyncio.run(_failovers(slow, kills))
    ms = 1000.0
    raw_name = "raw pysyncobj call, 3 processes"
    rows += [
        Row("sequential write p50, client", "ms", statistics.median(via_client) * ms, statistics.median(raw_seq) * ms, raw_name, False),
        Row("sequential write p99, client", "ms", _pct(via_client, 0.99) * ms, _pct(raw_seq, 0.99) * ms, raw_name, False),
        Row("sequential write p50, HTTP", "ms", statistics.median(via_http) * ms, statistics.median(raw_seq) * ms, raw_name, False),
        Row("sequential write p99, HTTP", "ms", _pct(via_http, 0.99) * ms, _pct(raw_seq, 0.99) * ms, raw_name, False),
        Row("sequential write p50, 1 replica", "ms", statistics.median(one_client) * ms, statistics.median(raw_alone) * ms, "raw pysyncobj call, no peers", False),
        Row("concurrent writes, client batching", "writes/s", conc_client, raw_conc, "raw pysyncobj, batched appends", True),
        Row("concurrent writes, HTTP x64", "writes/s", conc_http, raw_conc, "raw pysyncobj, batched appends", True),
        Row("failover p50 (kill -9 -> write)", "s", statistics.median(failover), statistics.median(failover_default), "pysyncobj default timings", False),
        Row("failover max", "s", max(failover), max(failover_default), "pysyncobj default timings", False),
        Row("512 nodes @1Hz: leader CPU", "% core", hb["busy_cpu"], hb["idle_cpu"], "same leader, idle", False),
        Row("512 nodes @1Hz: heartbeat p99", "ms", hb["p99"], hb["p50"], "heartbeat p50", False),
        Row("dead-node detection", "s", hb["detected"], 2.0, "configured dead_after", False),
    ]  # fmt: skip
    return rows
