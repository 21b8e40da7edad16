"""The admin API's handlers, each `(ApiContext, Call) -> Response`; the table is in route_table.py.

Writes go through `ApiContext.write`: the command is validated, stamped with the proposer's
clock and the request's operation id, proposed on the local replica (pysyncobj forwards it to
the leader when this replica follows) and answered once applied here, so a client reads its
own writes on the replica it wrote to. Heartbeats are the exception: they live in the leader's
memory, so a follower forwards them to the leader's API over HTTP.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from shoal.raft import commands as cmd
from shoal.raft.client import read_json
from shoal.raft.context import ApiContext, raise_refusal
from shoal.raft.errors import NotFound, NotLeader, ValidationError
from shoal.raft.machine import StateMachine
from shoal.raft.metrics import Gauges, cluster_gauges
from shoal.raft.model import LIVENESS, TASK_STATES
from shoal.raft.routes import Call, Param

MAX_EVENTS_PER_READ = 1000
POLL_PERIOD = 0.05
SECRET_WORDS = ("TOKEN", "SECRET")
"""A task's `args.env` variable whose name holds one of these is shown to the read role as
REDACTED: a dashboard or scraper needs to see that it is set, not what it is."""
REDACTED = "<redacted>"


def reply(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _find(items: dict[str, Any], key: str, what: str, listing: str) -> Any:
    if key not in items:
        raise NotFound(f"no {what} {key!r}; see GET {listing}")
    return items[key]


async def _maybe_consistent(ctx: ApiContext, call: Call) -> None:
    if call.query.get("consistent"):
        await ctx.barrier()


CONSISTENT = Param(
    "consistent", {"type": "boolean"}, "read through the Raft log first (linearizable)"
)

# -- cluster --------------------------------------------------------------------------------


async def healthz(ctx: ApiContext, call: Call) -> web.Response:
    return reply({"ok": True, "replica": ctx.config.replica_id, "leader": ctx.bridge.is_leader()})


async def get_cluster(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    status = ctx.bridge.status()
    leader = ctx.state.leader_record()
    # The digest hashes the whole state: computed only when asked for.
    want_digest = call.query.get("digest", False)
    digest, applied = ctx.read(lambda m: (m.digest() if want_digest else None, m.applied_count))
    return reply(
        {
            "replica": ctx.config.replica_id,
            "raft": ctx.config.raft,
            "api": ctx.config.api_url,
            **status,
            "leader_api": leader["api"] if leader and leader["raft"] == status["leader"] else None,
            "leader_id": leader["replica_id"]
            if leader and leader["raft"] == status["leader"]
            else None,
            "digest": digest,
            "applied_commands": applied,
        }
    )


async def batch(ctx: ApiContext, call: Call) -> web.Response:
    members = [
        {
            "op": c["op"],
            "op_id": c.get("op_id") or call.derived_id(f"batch[{i}]", 32),
            "at": time.time(),
            "args": c["args"],
        }
        for i, c in enumerate(call.body["commands"])
    ]
    command = {"op": "batch", "op_id": call.op_id, "at": time.time(), "args": {"commands": members}}
    try:
        cmd.validate_command(command)
    except ValidationError as exc:  # name the field as the caller sent it
        raise type(exc)(exc.field.replace("command.args.", "body.", 1), exc.message) from None
    result = await ctx.bridge.propose(command, ctx.config.write_timeout)
    raise_refusal(result)
    ctx.metrics.inc(
        "shoal_raft_commands_total", "commands committed", len(members), op="batch", ok="true"
    )
    return reply(result)


# -- nodes ----------------------------------------------------------------------------------


def _node_view(m: StateMachine, node_id: str) -> dict[str, Any]:
    node = _find(m.nodes, node_id, "node", "/v1/nodes")
    return {**asdict(node), "tasks": m.tasks_on(node_id)}


async def list_nodes(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    want = call.query.get("liveness")
    nodes = ctx.read(lambda m: [asdict(n) for n in m.nodes.values() if want in (None, n.liveness)])
    return reply({"nodes": nodes})


async def get_node(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    return reply(ctx.read(lambda m: _node_view(m, call.path["node_id"])))


async def register_node(ctx: ApiContext, call: Call) -> web.Response:
    result = await ctx.write("register_node", call.body, call.op_id)
    if ctx.bridge.is_leader():
        ctx.liveness.heartbeat(call.body["node_id"], time.time(), None)
    return reply(result["node"], 201)


async def _flag(ctx: ApiContext, call: Call, op: str, key: str, value: bool) -> web.Response:
    result = await ctx.write(op, {"node_id": call.path["node_id"], key: value}, call.op_id)
    return reply(result["node"])


async def cordon_node(ctx: ApiContext, call: Call) -> web.Response:
    return await _flag(ctx, call, "set_cordon", "cordoned", True)


async def uncordon_node(ctx: ApiContext, call: Call) -> web.Response:
    return await _flag(ctx, call, "set_cordon", "cordoned", False)


async def drain_node(ctx: ApiContext, call: Call) -> web.Response:
    return await _flag(ctx, call, "set_draining", "draining", True)


async def heartbeat(ctx: ApiContext, call: Call) -> web.StreamResponse:
    node_id = call.path["node_id"]
    if not ctx.bridge.is_leader():
        return await _forward_to_leader(ctx, call)
    view = ctx.read(lambda m: _node_view(m, node_id))
    ctx.liveness.heartbeat(node_id, time.time(), call.body.get("health"))
    ctx.metrics.inc("shoal_heartbeats_total", "heartbeats received by the leader")
    tasks, faults, peers = ctx.read(
        lambda m: (
            [asdict(m.tasks[t]) for t in view["tasks"]],
            [asdict(f) for f in m.faults_for(node_id)],
            m.peers(node_id),
        )
    )
    return reply(
        {
            "node_id": node_id,
            "liveness": view["liveness"],
            "cordoned": view["cordoned"],
            "tasks": tasks,
            "faults": faults,
            "peers": peers,
        }
    )


async def _forward_to_leader(ctx: ApiContext, call: Call) -> web.StreamResponse:
    status = ctx.bridge.status()
    leader = ctx.state.leader_record()
    if (
        leader is None
        or status["leader"] is None
        or leader["raft"] != status["leader"]
        or ctx.session is None
    ):
        raise NotLeader("no leader known to this replica yet; retry shortly", status["leader"])
    url = f"{leader['api']}{call.raw.rel_url}"
    headers = {"Authorization": call.raw.headers.get("Authorization", "")}
    try:
        async with ctx.session.post(url, json=call.body, headers=headers) as resp:
            return reply(await read_json(resp), resp.status)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise NotLeader(
            f"the leader at {leader['api']} did not answer ({exc!r})", leader["api"]
        ) from None


# -- jobs and tasks -------------------------------------------------------------------------


async def list_jobs(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    want = call.query.get("state")
    jobs = ctx.read(lambda m: [asdict(j) for j in m.jobs.values() if want in (None, j.state)])
    return reply({"jobs": jobs})


async def submit_job(ctx: ApiContext, call: Call) -> web.Response:
    args = {"job_id": call.derived_id("job"), **call.body}
    result = await ctx.write("submit_job", args, call.op_id)
    return reply(result["job"], 201)


def for_role(task: dict[str, Any], role: str) -> dict[str, Any]:
    """A task record as `role` may see it: for the read role, the values of its `args.env`
    variables named like a secret (TOKEN, SECRET) replaced by REDACTED; else unchanged."""
    env = task.get("args", {}).get("env")
    if role != "read" or not isinstance(env, dict):
        return task
    shown = {
        name: REDACTED if any(w in str(name).upper() for w in SECRET_WORDS) else value
        for name, value in env.items()
    }
    return {**task, "args": {**task["args"], "env": shown}}


def _job_view(m: StateMachine, job_id: str, role: str) -> dict[str, Any]:
    job = _find(m.jobs, job_id, "job", "/v1/jobs")
    tasks = [for_role(asdict(t), role) for t in m.tasks.values() if t.job_id == job_id]
    cps = [asdict(c) for c in m.checkpoints.values() if c.job_id == job_id]
    return {**asdict(job), "tasks": tasks, "checkpoints": cps}


async def get_job(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    return reply(ctx.read(lambda m: _job_view(m, call.path["job_id"], call.role)))


async def stop_job(ctx: ApiContext, call: Call) -> web.Response:
    result = await ctx.write("stop_job", {"job_id": call.path["job_id"]}, call.op_id)
    return reply(result["job"])


async def add_tasks(ctx: ApiContext, call: Call) -> web.Response:
    result = await ctx.write("add_tasks", {"job_id": call.path["job_id"], **call.body}, call.op_id)
    return reply(result, 201)


async def list_tasks(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    q = call.query

    def pick(m: StateMachine) -> list[dict[str, Any]]:
        return [
            for_role(asdict(t), call.role)
            for t in m.tasks.values()
            if q.get("node") in (None, t.node)
            and q.get("job") in (None, t.job_id)
            and q.get("state") in (None, t.state)
        ]

    return reply({"tasks": ctx.read(pick)})


async def get_task(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    task = ctx.read(lambda m: asdict(_find(m.tasks, call.path["task_id"], "task", "/v1/tasks")))
    return reply(for_role(task, call.role))


async def set_task_state(ctx: ApiContext, call: Call) -> web.Response:
    result = await ctx.write(
        "set_task_state", {"task_id": call.path["task_id"], **call.body}, call.op_id
    )
    return reply(result["task"])


async def publish_task_state(ctx: ApiContext, call: Call) -> web.Response:
    cmd.check_published_size(call.body["state"], "body.state")  # the rule its schema names
    result = await ctx.write(
        "publish_task_state", {"task_id": call.path["task_id"], **call.body}, call.op_id
    )
    return reply({k: result[k] for k in ("task_id", "generation", "published")})


async def place_tasks(ctx: ApiContext, call: Call) -> web.Response:
    return reply(await ctx.write("place_tasks", call.body, call.op_id))


# -- checkpoints and events -------------------------------------------------------------------


async def list_checkpoints(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    job = call.query.get("job")
    cps = ctx.read(lambda m: [asdict(c) for c in m.checkpoints.values() if job in (None, c.job_id)])
    return reply({"checkpoints": cps})


async def record_checkpoint(ctx: ApiContext, call: Call) -> web.Response:
    result = await ctx.write("record_checkpoint", call.body, call.op_id)
    return reply(result["checkpoint"], 201)


async def list_events(ctx: ApiContext, call: Call) -> web.Response:
    await _maybe_consistent(ctx, call)
    since = call.query.get("since", 0)
    limit = call.query.get("limit", MAX_EVENTS_PER_READ)
    deadline = time.monotonic() + call.query.get("wait", 0.0)

    def pick(m: StateMachine) -> tuple[list[dict[str, Any]], int]:
        return [asdict(e) for e in m.events if e.seq > since][:limit], m.event_seq

    events, last = ctx.read(pick)
    while not events and time.monotonic() < deadline:
        await asyncio.sleep(POLL_PERIOD)
        events, last = ctx.read(pick)
    return reply({"events": events, "last_seq": last})


async def add_event(ctx: ApiContext, call: Call) -> web.Response:
    return reply(await ctx.write("add_event", call.body, call.op_id), 201)


def _running(m: StateMachine) -> set[str]:
    return {job.id for job in m.jobs.values() if job.state == "running"}


async def metrics(ctx: ApiContext, call: Call) -> web.Response:
    status = ctx.bridge.status()
    counts = ctx.read(
        lambda m: {lv: sum(n.liveness == lv for n in m.nodes.values()) for lv in LIVENESS}
    )
    tasks = ctx.read(
        lambda m: {s: sum(t.state == s for t in m.tasks.values()) for s in TASK_STATES}
    )
    gauges: Gauges = {
        "shoal_raft_term": ("current Raft term", {(): status["term"]}),
        "shoal_raft_commit_index": ("Raft commit index", {(): status["commit_index"]}),
        "shoal_raft_is_leader": ("1 on the leader", {(): float(status["state"] == "leader")}),
        "shoal_nodes": ("nodes by liveness", {(("liveness", k),): v for k, v in counts.items()}),
        "shoal_tasks": ("tasks by state", {(("state", k),): v for k, v in tasks.items()}),
    }
    now = time.time()
    gauges.update(
        ctx.read(lambda m: cluster_gauges(m.nodes.values(), m.tasks.values(), _running(m), now))
    )
    return web.Response(
        text=ctx.metrics.render(gauges),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )
