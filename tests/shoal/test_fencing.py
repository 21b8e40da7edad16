"""Self-fencing of a node cut off from the coordinators (`shoal node --fence-after S`).

The fence decision is a pure clock (hypothesis); the option is validated; and end to end, a real
coordinator replica and two real node daemons, each reaching it only through its own fault
proxy, each running a learner rank as a child process: both links are cut, the fenced node
stops its rank (without reporting it ended) while the unfenced one keeps its own, and after
healing the fenced node starts the rank again at the generation still placed there.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.agent_policy import AgentConfig, FenceClock, heartbeat_backoff
from shoal.chaos.proxy import FaultProxy
from shoal.chaos.traffic import NetFaults
from shoal.errors import ConfigError
from shoal.local import LocalCluster, coordinator_specs
from shoal.raft.client import CoordinatorClient
from tests.support.processes import kill_quietly, logged_process, pid_alive
from tests.support.waiting import eventually, eventually_async

HERE = Path(__file__).parent
T = TypeVar("T")
FENCE_AFTER_S = 3.0  # ten heartbeats: a loaded machine does not fence a node the proxy lets through

# -- the fence decision (pure) ----------------------------------------------------------------

EVENTS = st.lists(
    st.tuples(st.sampled_from(["contact", "check"]), st.floats(0.0, 3.0)), max_size=40
)


@given(st.floats(0.01, 100.0), st.floats(0.0, 1e6), EVENTS)
def test_a_node_fences_once_per_silence_and_a_contact_lifts_it(
    after: float, start: float, events: list[tuple[str, float]]
) -> None:
    clock = FenceClock(after, start)
    now, last, fenced = start, start, False
    for kind, step in events:
        now += step
        if kind == "contact":
            assert clock.contact(now) == fenced
            last, fenced = now, False
        else:
            due = not fenced and now >= last + after
            assert clock.check(now) == due
            fenced = fenced or due
        assert clock.fenced == fenced


@given(st.floats(0.01, 100.0), st.floats(0.0, 1e6), st.floats(0.0, 200.0))
def test_sleeping_the_wait_reaches_the_fence_and_no_sooner(
    after: float, start: float, elapsed: float
) -> None:
    clock = FenceClock(after, start)
    now = start + elapsed
    wait = clock.wait(now)
    rounding = 1e-9 * max(1.0, now)  # the loop just checks again after an early wake
    assert 0.0 <= wait <= after + rounding
    if wait > rounding:
        assert not clock.check(now)
    assert clock.check(now + wait + rounding)
    assert clock.wait(now + wait + rounding) == after  # fenced: nothing to do until a contact


@given(st.floats(0.01, 100.0), st.floats(0.0, 1e6), st.floats(0.0, 1e3))
def test_a_late_contact_restarts_the_silence(after: float, start: float, gap: float) -> None:
    clock = FenceClock(after, start)
    contact = start + gap
    clock.contact(contact)
    assert not clock.check(contact + after * 0.5)
    assert clock.check(contact + after)


@given(st.floats(0.05, 10.0), st.floats(0.1, 60.0), st.integers(1, 20))
def test_a_fencing_node_retries_failed_heartbeats_at_the_period(
    period: float, fence_after: float, failures: int
) -> None:
    fencing = heartbeat_backoff(AgentConfig(heartbeat_s=period, fence_after_s=fence_after))
    assert [fencing.take() for _ in range(failures)] == [period] * failures
    plain = heartbeat_backoff(AgentConfig(heartbeat_s=period, backoff_max_s=60.0))
    assert [plain.take() for _ in range(2)] == [period, min(60.0, period * 2)]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "3"])
def test_a_bad_fence_after_names_the_key_and_what_is_valid(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"fence_after_s=.* is invalid: use a number of seconds"):
        AgentConfig(fence_after_s=value)


def test_fencing_is_off_unless_asked_for() -> None:
    assert AgentConfig().fence_after_s is None
    assert AgentConfig(fence_after_s=2.5).fence_after_s == 2.5


@pytest.mark.timeout(60)
def test_shoal_node_refuses_a_bad_fence_after_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shoal", "node", "--coordinators", "http://127.0.0.1:9",
         "--data-dir", str(tmp_path), "--fence-after", "-2"],
        capture_output=True, text=True, timeout=50,
        env={**os.environ, "SHOAL_API_TOKEN": "t" * 32},
    )  # fmt: skip
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shoal: error: fence_after_s=-2.0 is invalid")


# -- end to end: a real coordinator, real node daemons behind real fault proxies --------------


class LoopThread:
    """An event loop in a thread of its own, where the fault proxies live, so the test body
    can block on files, processes and HTTP without stalling the proxies' forwarding."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass
class Node:
    name: str
    data_dir: Path
    log: Path
    process: subprocess.Popen[bytes]
    proxy: FaultProxy
    rank: Path
    """The sleeper's base path: `<rank>.g<generation>.pid` while up, `<rank>.g<gen>` on SIGTERM."""

    def metrics(self) -> str:
        url = json.loads((self.data_dir / "node.json").read_text())["metrics"]
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


@dataclass
class Setup:
    local: LocalCluster
    loop: LoopThread
    tmp: Path

    def client(self) -> CoordinatorClient:
        return CoordinatorClient(
            self.local.api_urls(), self.local.token, timeout=15.0, request_timeout=2.0
        )

    def ask(self, body: Callable[[CoordinatorClient], Awaitable[T]]) -> T:
        async def go() -> T:
            async with self.client() as client:
                return await body(client)

        return self.loop.call(go())

    def set_faults(self, proxy: FaultProxy, faults: NetFaults) -> None:
        async def apply() -> None:
            proxy.set_faults(faults)

        self.loop.call(apply())


def counter(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def file_text(path: Path) -> str:
    return eventually(lambda: path.exists() and path.read_text(), f"{path} written") or ""


@contextmanager
def node_behind_proxy(setup: Setup, name: str, *extra: str) -> Iterator[Node]:
    """A `shoal node` daemon whose only way to the coordinator is its own fault proxy."""
    host, port = setup.local.api_urls()[0].removeprefix("http://").rsplit(":", 1)
    proxy = setup.loop.call(FaultProxy((host, int(port))).start())
    data_dir, log = setup.tmp / name, setup.tmp / f"{name}.log"
    argv = [
        sys.executable, "-m", "shoal", "node",
        "--coordinators", f"http://127.0.0.1:{proxy.port}",
        "--data-dir", str(data_dir), "--token-file", str(setup.local.run_dir / "api-token"),
        "--node-id", name, "--heartbeat", "0.3", "--health-period", "0.5",
        "--stop-timeout", "5", "--metrics", "127.0.0.1:0", *extra,
    ]  # fmt: skip
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    try:
        with logged_process(argv, log, {**os.environ, "PYTHONPATH": path}) as process:
            node = Node(name, data_dir, log, process, proxy, setup.tmp / f"{name}-rank")
            try:
                yield node
            except BaseException:
                print(f"--- {name} ---\n{node.tail()}")
                raise
    finally:
        setup.loop.call(proxy.close())
        for pid_file in setup.tmp.glob(f"{name}-rank.g*.pid"):
            text = pid_file.read_text()
            if text.isdigit():
                kill_quietly(int(text))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    local = LocalCluster(tmp_path / "run")
    # dead-after far beyond the partition: the ranks stay placed where they are.
    local.create(
        coordinator_specs(local.run_dir, 1, ("--suspect-after", "20", "--dead-after", "60"))
    )
    loop = LoopThread()
    try:
        local.start_all()
        local.wait_ready()
        yield Setup(local, loop, tmp_path)
    finally:
        local.stop_all()
        loop.close()


def rank_task(node: Node) -> dict[str, Any]:
    return {
        "task_id": f"{node.name}-rank",
        "kind": "learner-rank",
        "actor": "test_node_tasks:sleeper",
        "args": {"argv": [str(node.rank)]},
    }


async def place_ranks(client: CoordinatorClient, nodes: list[Node]) -> None:
    async def registered() -> bool:
        known = {n["id"]: n for n in await client.nodes()}
        return all(n.name in known and known[n.name]["liveness"] == "alive" for n in nodes)

    await eventually_async(registered, "the nodes registered")
    tasks = [rank_task(n) for n in nodes]
    spec = {"test": True, "placement": "manual"}
    await client.submit_job(spec=spec, tasks=tasks, job_id="fence-job")
    await client.place_tasks({t["task_id"]: n.name for t, n in zip(tasks, nodes, strict=True)})


async def task_record(client: CoordinatorClient, task_id: str) -> dict[str, Any]:
    return dict(await client.request("GET", f"/v1/tasks/{task_id}") or {})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cut_off_node_fences_its_rank_and_runs_it_again_once_healed(setup: Setup) -> None:
    with (
        node_behind_proxy(setup, "n1", "--fence-after", str(FENCE_AFTER_S)) as fenced,
        node_behind_proxy(setup, "n2") as plain,
    ):
        setup.ask(lambda c: place_ranks(c, [fenced, plain]))
        fenced_pid = int(file_text(Path(f"{fenced.rank}.g1.pid")))
        plain_pid = int(file_text(Path(f"{plain.rank}.g1.pid")))
        assert counter(fenced.metrics(), "shoal_node_fenced_total") == 0

        for node in (fenced, plain):
            setup.set_faults(node.proxy, NetFaults(partition="blackhole"))
        cut_at = time.monotonic()
        # SIGTERM came from the fence: the sleeper wrote its "checkpoint" and is gone.
        assert file_text(Path(f"{fenced.rank}.g1")).startswith("terminated")
        eventually(lambda: not pid_alive(fenced_pid), "the fenced rank gone")
        Path(f"{fenced.rank}.g1.pid").unlink()
        # The unfenced node keeps its rank through the same silence (the old behaviour).
        time.sleep(max(0.0, cut_at + FENCE_AFTER_S + 1.0 - time.monotonic()))
        assert pid_alive(plain_pid)
        assert not Path(f"{plain.rank}.g1").exists()
        assert "fenced" not in plain.log.read_text()
        assert fenced.log.read_text().count("fenced: no coordinator accepted a heartbeat") == 1

        for node in (fenced, plain):
            setup.set_faults(node.proxy, NetFaults())
        # Still placed there at generation 1: the first accepted reply starts it again, which
        # also shows the fenced stop was not recorded as done.
        restarted = int(file_text(Path(f"{fenced.rank}.g1.pid")))
        assert restarted != fenced_pid
        assert pid_alive(restarted)
        assert "unfenced: a heartbeat was accepted" in fenced.log.read_text()
        record = setup.ask(lambda c: task_record(c, "n1-rank"))
        assert (record["state"], record["node"], record["generation"]) == ("running", "n1", 1)
        metrics = fenced.metrics()
        assert counter(metrics, "shoal_node_fenced_total") == 1
        assert counter(metrics, "shoal_node_tasks_finished_total") is None  # nothing reported
        assert pid_alive(plain_pid)
