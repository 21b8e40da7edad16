"""The operator's dashboard: the page at `/` and the one JSON view it long-polls.

The page shell holds no data, so it is public; the view needs the bearer token like every other
route (the page sends it in the `Authorization` header, never in the URL, so it never reaches an
access log). The view waits until the replica has applied something newer than the caller last
saw: every change the dashboard shows (health summaries included) is a replicated command, so
"applied count moved" is exactly "something to redraw".

Training curves come from events of kind `job_metrics` whose fields carry `job`, `step` and
numbers (return, sps, policy_lag, losses): whatever a learner records is plotted, key by key.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aiohttp import web

from shoal.raft.context import ApiContext
from shoal.raft.handlers import for_role
from shoal.raft.machine import StateMachine
from shoal.raft.routes import Call, Param, Route
from shoal.scheduler.health.presence import read_states, read_util_source

PAGE = Path(__file__).with_name("dashboard.html")
METRICS_KIND = "job_metrics"
RECENT_EVENTS = 200
MAX_POINTS = 500
MAX_WAIT = 25.0
POLL_PERIOD = 0.1
# The page is inline HTML/CSS/JS and talks only to this origin.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


def node_gpus(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The node's GPUs with their utilisation (0..1, None when unknown): per GPU when the
    health carries `gpus`, else the node's mean `gpu_util` for each (all a summary has)."""
    health = node.get("health") or {}
    summary = health.get("summary", health)
    per_gpu = {
        g.get("index"): g.get("utilisation") for g in health.get("gpus", []) if isinstance(g, dict)
    }
    mean = summary.get("gpu_util") if isinstance(summary, dict) else None
    return [
        {
            "node": node["id"],
            "index": gpu["index"],
            "island": gpu["island"] or f"{node['id']}/local",
            "domain": gpu["domain"],
            "util": _fraction(per_gpu.get(gpu["index"], mean)),
            "liveness": node["liveness"],
        }
        for gpu in node["resources"]["gpus"]
    ]


def health_sources(health: Any) -> dict[str, Any]:
    """The node's health collectors (name -> state and reason) and the source of its GPU
    utilisation, checked and bounded: the page shows them as a node sent them."""
    return {"collectors": read_states(health), "gpu_util_source": read_util_source(health)}


def _fraction(value: Any) -> float | None:
    number = _number(value)
    return None if number is None else min(1.0, max(0.0, number))


def islands(nodes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPUs grouped by NVLink island (a GPU with no island is its node's own island), islands
    sorted by domain then name, GPUs by node then index: a stable layout for the heat map."""
    groups: dict[str, dict[str, Any]] = {}
    for node in nodes:
        for gpu in node_gpus(node):
            group = groups.setdefault(
                gpu["island"], {"island": gpu["island"], "domain": gpu["domain"], "gpus": []}
            )
            group["gpus"].append(gpu)
    for group in groups.values():
        group["gpus"].sort(key=lambda g: (g["node"], g["index"]))
    return sorted(groups.values(), key=lambda g: (g["domain"], g["island"]))


def job_curves(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, list[list[float]]]]:
    """job id -> metric -> [[step, value], ...] in step order, from `job_metrics` events;
    non-numeric fields are skipped and each series keeps its newest MAX_POINTS points."""
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for event in events:
        fields = event.get("fields") or {}
        job, step = fields.get("job"), _number(fields.get("step"))
        if event.get("kind") != METRICS_KIND or not isinstance(job, str) or step is None:
            continue
        for key, value in fields.items():
            number = _number(value)
            if key in ("job", "step") or number is None:
                continue
            curves.setdefault(job, {}).setdefault(key, []).append([step, number])
    for series in curves.values():
        for key, points in series.items():
            points.sort(key=lambda p: p[0])
            series[key] = points[-MAX_POINTS:]
    return curves


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _jobs(m: StateMachine, role: str) -> list[dict[str, Any]]:
    out = []
    for job in m.jobs.values():
        tasks = [for_role(asdict(t), role) for t in m.tasks.values() if t.job_id == job.id]
        cps = [asdict(c) for c in m.checkpoints.values() if c.job_id == job.id]
        out.append({**asdict(job), "tasks": tasks, "checkpoints": cps})
    return sorted(out, key=lambda j: -j["submitted_at"])


def view(m: StateMachine, role: str = "read") -> dict[str, Any]:
    """Everything the page draws, read in one pass under the state's lock (copies only); the
    read role's copy has its tasks' secret environment values redacted."""
    nodes = [
        {**asdict(n), "tasks": m.tasks_on(n.id), **health_sources(n.health)}
        for n in m.nodes.values()
    ]
    events = [asdict(e) for e in m.events]
    return {
        "applied": m.applied_count,
        "nodes": sorted(nodes, key=lambda n: n["id"]),
        "islands": islands(nodes),
        "jobs": _jobs(m, role),
        "curves": job_curves(events),
        "events": [e for e in events if e["kind"] != METRICS_KIND][-RECENT_EVENTS:],
        "last_seq": m.event_seq,
    }


async def dashboard_page(ctx: ApiContext, call: Call) -> web.Response:
    return web.Response(
        body=PAGE.read_bytes(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP},
    )


async def _wait_for_change(ctx: ApiContext, after: int, wait: float) -> None:
    """Until more than `after` commands are applied here, or `wait` seconds passed."""
    deadline = time.monotonic() + wait
    while True:
        if ctx.read(lambda m: m.applied_count) > after or time.monotonic() >= deadline:
            return
        await asyncio.sleep(POLL_PERIOD)


async def dashboard_view(ctx: ApiContext, call: Call) -> web.Response:
    await _wait_for_change(ctx, call.query.get("after", -1), call.query.get("wait", 0.0))
    data = ctx.read(lambda m: view(m, call.role))
    status = ctx.bridge.status()
    leader = ctx.state.leader_record()
    known = leader is not None and leader["raft"] == status["leader"]
    data["cluster"] = {
        **status,
        "replica": ctx.config.replica_id,
        "api": ctx.config.api_url,
        "leader_id": leader["replica_id"] if known and leader else None,
        "leader_api": leader["api"] if known and leader else None,
        "now": time.time(),
    }
    return web.json_response(data, headers={"Cache-Control": "no-store"})


DASHBOARD_ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/",
        dashboard_page,
        "the dashboard page (holds no data; it asks for the token)",
        role="none",
        tag="dashboard",
    ),
    Route(
        "GET",
        "/v1/dashboard",
        dashboard_view,
        "cluster, nodes by island, jobs, curves, events: once `after` is passed",
        query=(
            Param(
                "after",
                {"type": "integer", "minimum": -1},
                "answer once more than this many commands are applied (the last `applied`)",
            ),
            Param(
                "wait",
                {"type": "number", "minimum": 0, "maximum": MAX_WAIT},
                "how long to hold the request waiting for a change, in seconds",
            ),
        ),
        tag="dashboard",
        role="read",
    ),
)
