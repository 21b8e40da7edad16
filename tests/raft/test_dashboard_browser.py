"""The dashboard in a real headless chromium against a real local cluster: three coordinator
replicas and two node daemons (simulated GPUs) as child processes, a submitted job with its
metrics. Chromium is driven over the DevTools protocol (a websocket, via aiohttp), so the test
waits for what the page shows instead of for a fixed time.

The slow test takes the screenshot during a real `shoal train cartpole` run on a cluster started
by `shoal up`, so the curves are that run's own `job_metrics`. Set SHOAL_DASHBOARD_SCREENSHOT=path
to keep it (docs/dashboard.png is made so).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shoal.local import LocalCluster, coordinator_specs
from shoal.raft.client import CoordinatorClient
from shoal.raft.dashboard import METRICS_KIND
from tests.support.waiting import eventually_async

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it)"),
]
NODES = ("gpu-a", "gpu-b")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,1000", "--remote-debugging-port=0",
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("dash")
    local = LocalCluster(tmp / "run")
    local.create(coordinator_specs(local.run_dir, 3))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        local.start_all()
        local.wait_ready()
        for name in NODES:
            nodes.append(_start_node(local, name, tmp))
        yield local
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        local.stop_all()


def _start_node(local: LocalCluster, name: str, tmp: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "shoal", "node",
        "--coordinators", ",".join(local.api_urls()),
        "--data-dir", str(tmp / name), "--token-file", str(local.run_dir / "api-token"),
        "--node-id", name, "--sim-gpus", "4", "--island-size", "2", "--domain", "rdma0",
        "--heartbeat", "0.3", "--health-period", "0.5",
    ]  # fmt: skip
    with open(tmp / f"{name}.log", "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


class DevTools:
    """One page target of a chromium, spoken to over its DevTools websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            reply = await self.ws.receive_json(timeout=30)
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll a JS expression until it is truthy; its value."""
        try:
            return await eventually_async(
                lambda: self.evaluate(expression), f"the page shows {expression!r}", timeout
            )
        except AssertionError as exc:
            body = await self.evaluate("document.body.innerText")
            raise AssertionError(f"{exc}; text: {body}") from exc


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"

    def port() -> int | None:
        text = marker.read_text().strip() if marker.exists() else ""
        if text:
            return int(text.split()[0])
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}")
        return None

    return await eventually_async(port, "chromium opens its DevTools port")


def _launch(tmp: Path, profile: Path) -> subprocess.Popen[bytes]:
    assert CHROMIUM is not None
    with open(tmp / "chromium.log", "wb") as log:
        return subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


@asynccontextmanager
async def chromium(tmp: Path) -> AsyncIterator[DevTools]:
    profile = tmp / "profile"
    proc = _launch(tmp, profile)
    try:
        port = await _devtools_port(profile, proc)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield DevTools(ws)
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def _submit_job_with_metrics(local: LocalCluster) -> str:
    async with CoordinatorClient(local.api_urls(), local.token, timeout=20) as client:
        job = await client.submit_job(spec={"env": "CartPole-v1", "algo": "ppo"})
        for step in range(0, 4000, 200):
            fields = {
                "job": job["id"], "step": step, "return": 20 + 450 * (1 - 0.999 ** step),
                "sps": 9000 + (step % 600), "policy_lag": 1 + (step // 200) % 3,
                "loss_policy": 0.05 / (1 + step / 500), "loss_value": 40 / (1 + step / 300),
            }  # fmt: skip
            await client.add_event(METRICS_KIND, f"step {step}", fields)
        await client.submit_job(
            job_id="gpu-job",
            tasks=[
                {
                    "task_id": "gpu-task",
                    "kind": "actor",
                    "actor": "shoal.runtime.actor:Actor",
                    "resources": {"gpus": 2},
                }
            ],
        )
        await client.record_checkpoint(job["id"], "/ckpt/3800.pt", 3800, "ab" * 32, True)
        await client.add_event(
            "evaluation", "evaluation report", {"job": job["id"], "report": "/reports/eval.html"}
        )
        return str(job["id"])


async def _cordon(local: LocalCluster, node_id: str) -> None:
    async with CoordinatorClient(local.api_urls(), local.token, timeout=20) as client:
        await client.cordon(node_id)


async def _wait_nodes_healthy(local: LocalCluster) -> None:
    async with CoordinatorClient(local.api_urls(), local.token, timeout=20) as client:

        async def healthy() -> bool:
            nodes = await client.nodes()
            return len(nodes) == len(NODES) and all(n["health"] for n in nodes)

        await eventually_async(healthy, "every node daemon reports health", timeout=60)


def test_the_page_shows_nodes_jobs_curves_live_and_keeps_the_token_out_of_the_url(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    async def body() -> bytes:
        await _wait_nodes_healthy(cluster)
        job_id = await _submit_job_with_metrics(cluster)
        async with chromium(tmp_path) as page:
            await page.call("Page.enable")
            await page.call("Page.navigate", url=f"{cluster.api_urls()[1]}/#token={cluster.token}")
            await page.wait_for(f"!!document.querySelector('[data-job=\"{job_id}\"]')")
            shown = await page.wait_for(
                "(() => { const n = [...document.querySelectorAll('[data-node]')]"
                ".map(e => e.dataset.node); return n.length >= 2 ? n : null })()"
            )
            assert sorted(shown) == sorted(NODES)
            sensors = await page.evaluate(
                f"[...document.querySelectorAll('[data-node=\"{NODES[0]}\"] [data-sensor]')]"
                ".map(e => [e.dataset.sensor, e.className, e.title])"
            )
            by_name = {name: (cls, title) for name, cls, title in sensors}
            assert by_name["host"][0] == "sensor up"
            assert by_name["dcgm"] == (
                "sensor absent",
                "dcgm absent: the node simulates its GPUs (--sim-gpus); DCGM would see the real ones",
            )
            assert await page.evaluate("document.querySelectorAll('svg[data-island] rect').length")
            metrics = await page.evaluate(
                f"[...document.querySelectorAll('[data-job=\"{job_id}\"] [data-metric]')]"
                ".map(e => e.dataset.metric)"
            )
            assert {"return", "sps", "policy_lag", "loss_policy", "loss_value"} <= set(metrics)
            # Each chart has both axes ticked and its unit named, every tick inside the chart.
            axes = await page.evaluate(
                f"[...document.querySelectorAll('[data-job=\"{job_id}\"] svg[data-metric]')]"
                ".map(c => [c.dataset.metric, c.querySelector('[data-unit]').dataset.unit,"
                " c.querySelectorAll('[data-tick=y]').length,"
                " c.querySelectorAll('[data-tick=x]').length,"
                " [...c.querySelectorAll('[data-tick]')].every(t => { const b = t.getBBox();"
                " return b.x >= 0 && b.x + b.width <= c.width.baseVal.value; })])"
            )
            units = {name: unit for name, unit, *_ in axes}
            assert units["sps"] == "env steps / s"
            assert units["policy_lag"] == "versions behind"
            assert all(y >= 2 and x >= 2 and inside for _, _, y, x, inside in axes), axes
            assert "checkpoint step 3800" in await page.evaluate("document.body.innerText")
            held = await page.wait_for(
                "document.querySelector('[data-task=\"gpu-task\"] [data-gpus]')?.dataset.gpus"
            )
            assert len(held.split(",")) == 2  # the GPUs the leader's placement gave the task
            assert await page.evaluate("!!document.querySelector('a[href=\"/reports/eval.html\"]')")
            assert await page.evaluate("location.href") == f"{cluster.api_urls()[1]}/"
            assert await page.evaluate("document.getElementById('conn').textContent") == "live"
            shot = await page.call("Page.captureScreenshot", format="png")
            await _cordon(cluster, NODES[1])  # the open page must redraw without a reload
            await page.wait_for(
                f"document.querySelector('[data-node=\"{NODES[1]}\"]').innerText"
                ".includes('cordoned')"
            )
        return base64.b64decode(shot["data"])

    png = asyncio.run(body())
    assert png.startswith(b"\x89PNG")
    (tmp_path / "dashboard.png").write_bytes(png)
    keep = os.environ.get("SHOAL_DASHBOARD_SCREENSHOT")
    if keep:
        Path(keep).write_bytes(png)


def _shoal(*argv: str) -> list[str]:
    return [sys.executable, "-m", "shoal", *argv]


async def _wait_job_metrics(local: LocalCluster, points: int, timeout: float) -> str:
    """The id of the first job with at least `points` job_metrics events (the learner posts one
    every few seconds), waiting up to `timeout` seconds."""
    async with CoordinatorClient(local.api_urls(), local.token, timeout=20) as client:
        counts: dict[str, int] = {}
        since = 0

        async def ready() -> str | None:
            nonlocal since
            page = await client.events(since=since, wait=2.0)
            for event in page["events"]:
                job = event["fields"].get("job") if event["kind"] == METRICS_KIND else None
                if job:
                    counts[job] = counts.get(job, 0) + 1
            since = max(since, int(page["last_seq"]))
            return next((job for job, n in counts.items() if n >= points), None)

        return await eventually_async(
            ready, f"a job posts {points} job_metrics events", timeout, lambda: f"{counts}"
        )


async def _screenshot_job(local: LocalCluster, job_id: str, tmp: Path) -> bytes:
    async with chromium(tmp) as page:
        await page.call("Page.enable")
        await page.call("Page.navigate", url=f"{local.api_urls()[0]}/#token={local.token}")
        await page.wait_for(f"!!document.querySelector('[data-job=\"{job_id}\"] [data-metric]')")
        await page.wait_for("document.querySelectorAll('[data-node]').length >= 2")
        shot = await page.call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_screenshot_during_a_real_training_run_shows_its_curves(tmp_path: Path) -> None:
    environ = {**os.environ, "SHOAL_RUN_DIR": str(tmp_path / "cluster")}
    up = _shoal("up", "--replicas", "3", "--nodes", "2", "--sim-gpus", "8", "--island-size", "4")
    train: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(up, env=environ, check=True, timeout=120, stdout=subprocess.DEVNULL)
        # No clock of its own that a loaded machine could reach before 8 metric points: the
        # test stops the run (Ctrl-C, an orderly stop) once the screenshot is taken.
        argv = _shoal("train", "cartpole", "--target-return", "1e9", "--time-limit", "600",
                      "--no-eval", "--quiet", "--run-dir", str(tmp_path / "train"))  # fmt: skip
        with open(tmp_path / "train.log", "wb") as log:
            train = subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)
        local = LocalCluster(tmp_path / "cluster")
        job_id = asyncio.run(_wait_job_metrics(local, points=8, timeout=150))
        png = asyncio.run(_screenshot_job(local, job_id, tmp_path))
        assert png.startswith(b"\x89PNG")
        train.send_signal(signal.SIGINT)
        assert train.wait(timeout=180) in (0, 1), (tmp_path / "train.log").read_text()
    finally:
        if train is not None and train.poll() is None:
            train.kill()
            train.wait(timeout=10)
        subprocess.run(_shoal("down"), env=environ, timeout=60, stdout=subprocess.DEVNULL)
    keep = os.environ.get("SHOAL_DASHBOARD_SCREENSHOT")
    if keep:
        Path(keep).write_bytes(png)


def test_a_wrong_token_shows_the_login_form_with_the_reason(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    async def body() -> None:
        async with chromium(tmp_path) as page:
            await page.call("Page.enable")
            await page.call("Page.navigate", url=f"{cluster.api_urls()[0]}/#token=wrong")
            message = await page.wait_for(
                "!document.getElementById('login').classList.contains('hidden')"
                " && document.getElementById('login-error').textContent"
            )
            assert "wrong bearer token" in message
            assert await page.evaluate("sessionStorage.getItem('shoal-token')") is None

    asyncio.run(body())
