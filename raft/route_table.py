"""The admin API's route table: every route, its handler, its body and query schemas.

`api.py` registers exactly these routes and `openapi.py` documents exactly these, so the
OpenAPI document cannot drift from what is served.
"""

from __future__ import annotations

from shoal.raft import commands as cmd
from shoal.raft.config_api import get_config
from shoal.raft.handlers import (
    CONSISTENT,
    MAX_EVENTS_PER_READ,
    add_event,
    add_tasks,
    batch,
    cordon_node,
    drain_node,
    get_cluster,
    get_job,
    get_node,
    get_task,
    healthz,
    heartbeat,
    list_checkpoints,
    list_events,
    list_jobs,
    list_nodes,
    list_tasks,
    metrics,
    place_tasks,
    publish_task_state,
    record_checkpoint,
    register_node,
    set_task_state,
    stop_job,
    submit_job,
    uncordon_node,
)
from shoal.raft.model import JOB_STATES, LIVENESS, TASK_STATES
from shoal.raft.routes import Param, Route
from shoal.raft.schema import Schema


def _body(op: str, drop: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> Schema:
    """A command's args schema as a request body, minus what the path supplies."""
    schema = cmd.ARG_SCHEMAS[op]
    props = {k: v for k, v in schema["properties"].items() if k not in drop}
    required = [k for k in schema["required"] if k not in drop and k not in optional]
    return {**schema, "properties": props, "required": required}


NOT_BATCHED = frozenset(
    {
        "announce_leader",
        "set_liveness",
        "report_health",
        "set_pending_reason",
        "inject_fault",
        "report_fault",
    }
)
"""Commands a client may not send in a batch: those only the leader proposes (its leadership,
which followers forward by, the liveness and health it decides, why its scheduler cannot
place a task) and the chaos commands,
whose own routes answer only where `[chaos] enabled` is set."""
BATCH_OPS = sorted(set(cmd.ARG_SCHEMAS) - NOT_BATCHED)
BATCH_BODY: Schema = {
    "type": "object",
    "required": ["commands"],
    "additionalProperties": False,
    "properties": {
        "commands": {
            "type": "array",
            "maxItems": cmd.MAX_BATCH,
            "items": {
                "type": "object",
                "required": ["op", "args"],
                "additionalProperties": False,
                "properties": {
                    "op": {"enum": BATCH_OPS},
                    "op_id": cmd.ID,
                    "args": {"type": "object", "additionalProperties": True},
                },
                # Each op's own arguments: the one alternative whose op matches.
                "oneOf": [
                    {
                        "type": "object",
                        "additionalProperties": True,
                        "properties": {"op": {"enum": [op]}, "args": cmd.ARG_SCHEMAS[op]},
                    }
                    for op in BATCH_OPS
                ],
            },
        }
    },
}
HEARTBEAT_BODY: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"health": cmd.FREE_OBJECT},
}
EMPTY: Schema = {"type": "object", "additionalProperties": False, "properties": {}}
ID_FILTER: Schema = cmd.ID

ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/healthz",
        healthz,
        "liveness of this replica (no token needed)",
        tag="meta",
        role="none",
    ),
    Route("GET", "/metrics", metrics, "Prometheus text metrics", tag="meta", role="read"),
    Route(
        "GET",
        "/v1/cluster",
        get_cluster,
        "leader, term, commit index, replicas and their lag",
        query=(
            CONSISTENT,
            Param(
                "digest", {"type": "boolean"}, "include the sha256 state digest (hashes all state)"
            ),
        ),
        role="read",
    ),
    Route(
        "GET",
        "/v1/config",
        get_config,
        "this replica's effective scheduler, balancer, liveness and raft settings, and their source",
        tag="meta",
        role="read",
    ),
    Route(
        "POST",
        "/v1/batch",
        batch,
        "apply many commands as one log entry",
        body=BATCH_BODY,
        write=True,
        role="operator",
    ),
    Route(
        "GET",
        "/v1/nodes",
        list_nodes,
        "list nodes",
        tag="nodes",
        query=(CONSISTENT, Param("liveness", {"enum": list(LIVENESS)}, "only nodes in this state")),
        role="read",
    ),
    Route(
        "POST",
        "/v1/nodes",
        register_node,
        "register (or re-register) a node",
        body=_body("register_node"),
        write=True,
        tag="nodes",
        role="node",
    ),
    Route(
        "GET",
        "/v1/nodes/{node_id}",
        get_node,
        "one node and the tasks placed on it",
        query=(CONSISTENT,),
        tag="nodes",
        role="read",
    ),
    Route(
        "POST",
        "/v1/nodes/{node_id}/heartbeat",
        heartbeat,
        "heartbeat with an optional health summary",
        body=HEARTBEAT_BODY,
        tag="nodes",
        role="node",
    ),
    Route(
        "POST",
        "/v1/nodes/{node_id}/cordon",
        cordon_node,
        "take no new tasks",
        body=EMPTY,
        write=True,
        tag="nodes",
        role="operator",
    ),
    Route(
        "POST",
        "/v1/nodes/{node_id}/uncordon",
        uncordon_node,
        "take tasks again (ends a drain)",
        body=EMPTY,
        write=True,
        tag="nodes",
        role="node",
    ),
    Route(
        "POST",
        "/v1/nodes/{node_id}/drain",
        drain_node,
        "cordon and mark draining (the scheduler moves its tasks away)",
        body=EMPTY,
        write=True,
        tag="nodes",
        role="node",
    ),
    Route(
        "GET",
        "/v1/jobs",
        list_jobs,
        "list jobs",
        tag="jobs",
        query=(CONSISTENT, Param("state", {"enum": list(JOB_STATES)}, "only jobs in this state")),
        role="read",
    ),
    Route(
        "POST",
        "/v1/jobs",
        submit_job,
        "submit a job (id generated when absent)",
        body=_body("submit_job", optional=("job_id",)),
        write=True,
        tag="jobs",
        role="operator",
    ),
    Route(
        "GET",
        "/v1/jobs/{job_id}",
        get_job,
        "a job with its tasks and checkpoints",
        query=(CONSISTENT,),
        tag="jobs",
        role="read",
    ),
    Route(
        "POST",
        "/v1/jobs/{job_id}/stop",
        stop_job,
        "stop a job and its tasks",
        body=EMPTY,
        write=True,
        tag="jobs",
        role="operator",
    ),
    Route(
        "POST",
        "/v1/jobs/{job_id}/tasks",
        add_tasks,
        "add tasks to a running job",
        body=_body("add_tasks", drop=("job_id",)),
        write=True,
        tag="jobs",
        role="operator",
    ),
    Route(
        "GET",
        "/v1/tasks",
        list_tasks,
        "list tasks",
        tag="tasks",
        query=(
            CONSISTENT,
            Param("node", ID_FILTER, "only tasks placed on this node"),
            Param("job", ID_FILTER, "only tasks of this job"),
            Param("state", {"enum": list(TASK_STATES)}, "only tasks in this state"),
        ),
        role="read",
    ),
    Route(
        "GET",
        "/v1/tasks/{task_id}",
        get_task,
        "one task",
        query=(CONSISTENT,),
        tag="tasks",
        role="read",
    ),
    Route(
        "PUT",
        "/v1/tasks/{task_id}/state",
        set_task_state,
        "report a task's state (node daemons)",
        body=_body("set_task_state", drop=("task_id",)),
        write=True,
        tag="tasks",
        role="node",
    ),
    Route(
        "PUT",
        "/v1/tasks/{task_id}/published",
        publish_task_state,
        "publish a small flat state for the task's generation (node daemons, for their tasks); "
        "its job's nodes get it in their heartbeat replies (`peers`), readers in the task",
        body=_body("publish_task_state", drop=("task_id",)),
        write=True,
        tag="tasks",
        role="node",
    ),
    Route(
        "POST",
        "/v1/placements",
        place_tasks,
        "place or unplace tasks (the scheduler)",
        body=_body("place_tasks"),
        write=True,
        tag="tasks",
        role="operator",
    ),
    Route(
        "GET",
        "/v1/checkpoints",
        list_checkpoints,
        "list checkpoints",
        tag="checkpoints",
        query=(CONSISTENT, Param("job", ID_FILTER, "only checkpoints of this job")),
        role="read",
    ),
    Route(
        "POST",
        "/v1/checkpoints",
        record_checkpoint,
        "record a checkpoint",
        body=_body("record_checkpoint"),
        write=True,
        tag="checkpoints",
        role="node",
    ),
    Route(
        "GET",
        "/v1/events",
        list_events,
        "events after `since`, waiting up to `wait` s for one",
        tag="events",
        query=(
            CONSISTENT,
            Param("since", {"type": "integer", "minimum": 0}, "return events with seq > since"),
            Param(
                "wait",
                {"type": "number", "minimum": 0, "maximum": 60},
                "long-poll this many seconds",
            ),
            Param(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": MAX_EVENTS_PER_READ},
                "at most this many",
            ),
        ),
        role="read",
    ),
    Route(
        "POST",
        "/v1/events",
        add_event,
        "append an event",
        body=_body("add_event"),
        write=True,
        tag="events",
        role="node",
    ),
)
