"""The chaos API: `/v1/chaos/faults`, served only by a replica whose config has `[chaos]
enabled = true`; otherwise the same paths answer 404 saying how to turn it on.

A fault asked for here is a replicated command (`inject_fault`) that names the node which
executes it; that node finds it in its next heartbeat reply, acts once and reports the outcome
(`report_fault`). Replicas never act on a fault: applying a command has no side effect.
"""

from __future__ import annotations

from dataclasses import asdict

from aiohttp import web

from shoal.raft import commands as cmd
from shoal.raft.context import ApiContext
from shoal.raft.errors import NotFound
from shoal.raft.fault_records import FAULT_KINDS, FAULT_STATES
from shoal.raft.handlers import CONSISTENT, reply
from shoal.raft.routes import Call, Param, Route
from shoal.raft.schema import Schema

FAULTS_PATH = "/v1/chaos/faults"
FAULT_PATH = "/v1/chaos/faults/{fault_id}"
OUTCOME_PATH = "/v1/chaos/faults/{fault_id}/outcome"
DISABLED_MESSAGE = (
    "chaos is disabled in this cluster's config: put `[chaos]` `enabled = true` in the file "
    "given to every replica (shoal coordinator --config FILE.toml, or shoal up "
    "--coordinator-config FILE.toml) and restart them"
)

INJECT_BODY: Schema = {
    "type": "object",
    "required": ["kind", "target"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": list(FAULT_KINDS)},
        "target": cmd.ID,
        "fault_id": cmd.ID,
        **cmd.FAULT_PARAMS,
    },
}
OUTCOME_BODY: Schema = {
    "type": "object",
    "required": ["state"],
    "additionalProperties": False,
    "properties": {
        "state": cmd.ARG_SCHEMAS["report_fault"]["properties"]["state"],
        "message": cmd.TEXT,
    },
}


async def inject_fault(ctx: ApiContext, call: Call) -> web.Response:
    cmd.check_fault_params(call.body, "body")
    args = {"fault_id": call.derived_id("fault"), **call.body}
    result = await ctx.write("inject_fault", args, call.op_id)
    return reply(result["fault"], 202)


async def list_faults(ctx: ApiContext, call: Call) -> web.Response:
    if call.query.get("consistent"):
        await ctx.barrier()
    q = call.query
    faults = ctx.read(
        lambda m: [
            asdict(f)
            for f in m.faults.values()
            if q.get("node") in (None, f.node) and q.get("state") in (None, f.state)
        ]
    )
    return reply({"faults": faults})


async def get_fault(ctx: ApiContext, call: Call) -> web.Response:
    if call.query.get("consistent"):
        await ctx.barrier()
    fault_id = call.path["fault_id"]
    fault = ctx.read(lambda m: asdict(m.faults[fault_id]) if fault_id in m.faults else None)
    if fault is None:
        raise NotFound(f"no fault {fault_id!r}; see GET {FAULTS_PATH}", "fault_id")
    return reply(fault)


async def report_fault(ctx: ApiContext, call: Call) -> web.Response:
    args = {"fault_id": call.path["fault_id"], **call.body}
    return reply((await ctx.write("report_fault", args, call.op_id))["fault"])


CHAOS_ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        FAULTS_PATH,
        inject_fault,
        "inject a fault (task-kill, task-pause, node-kill, gpu-xid); its node executes it",
        body=INJECT_BODY,
        write=True,
        tag="chaos",
        accepted=True,
        role="operator",
    ),
    Route(
        "GET",
        FAULTS_PATH,
        list_faults,
        "recent faults and their outcomes, oldest first",
        query=(
            CONSISTENT,
            Param("node", cmd.ID, "only faults executed by this node"),
            Param("state", {"enum": list(FAULT_STATES)}, "only faults in this state"),
        ),
        tag="chaos",
        role="read",
    ),
    Route("GET", FAULT_PATH, get_fault, "one fault", query=(CONSISTENT,), tag="chaos", role="read"),
    Route(
        "PUT",
        OUTCOME_PATH,
        report_fault,
        "report a fault's outcome (node daemons)",
        body=OUTCOME_BODY,
        write=True,
        tag="chaos",
        role="node",
    ),
)


async def chaos_disabled(ctx: ApiContext, call: Call) -> web.Response:
    raise NotFound(DISABLED_MESSAGE)


DISABLED_ROUTES: tuple[Route, ...] = tuple(
    Route(r.method, r.path, chaos_disabled, "404: chaos is disabled", tag="chaos", role=r.role)
    for r in CHAOS_ROUTES
)
"""What a replica without chaos serves on the chaos paths: the token is still checked, then
every call is a 404 whose message says how to enable chaos (never aiohttp's bare 404)."""


def chaos_routes(enabled: bool) -> tuple[Route, ...]:
    return CHAOS_ROUTES if enabled else DISABLED_ROUTES
