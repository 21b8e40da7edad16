"""The replicated commands: their schemas and the pure validation run BEFORE proposing.

A command is a plain dict `{"op", "op_id", "at", "args"}`. The proposer stamps `op_id` (which
makes a retry idempotent) and `at` (the only time the state machine ever sees), so applying a
command needs no clock, randomness or I/O. `validate_command` accepts exactly what
`StateMachine.apply` can apply without raising; state-dependent refusals (unknown id, duplicate
id) are results of `apply`, identical on every replica.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.raft.errors import PayloadTooLarge, RuleViolation, ValidationError
from shoal.raft.fault_records import FAULT_KINDS, FAULT_STATES
from shoal.raft.model import (
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BACKOFF_S,
    LIVENESS,
    TASK_STATES,
)
from shoal.raft.schema import Schema, check

MAX_COMMAND_BYTES = 1 << 20
MAX_BATCH = 10_000

ID: Schema = {
    "type": "string",
    "minLength": 1,
    "maxLength": 128,
    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$",
}
TEXT: Schema = {"type": "string", "maxLength": 4096}
FREE_OBJECT: Schema = {"type": "object", "description": "free-form JSON"}
STAMP: Schema = {"type": "number", "minimum": 0}

GPU: Schema = {
    "type": "object",
    "required": ["index", "uuid"],
    "additionalProperties": False,
    "properties": {
        "index": {"type": "integer", "minimum": 0, "maximum": 1023},
        "uuid": {"type": "string", "minLength": 1, "maxLength": 128},
        "island": {"type": "string", "maxLength": 128},
        "domain": {"type": "string", "maxLength": 128},
    },
}
NODE_RESOURCES: Schema = {
    "type": "object",
    "required": ["cpus", "memory"],
    "additionalProperties": False,
    "properties": {
        "cpus": {"type": "number", "minimum": 0},
        "memory": {"type": "integer", "minimum": 0},
        "gpus": {
            "type": "array",
            "maxItems": 1024,
            "items": GPU,
            "description": "rule: no two GPUs share an index",
        },
    },
}
TASK_RESOURCES: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "cpus": {"type": "number", "minimum": 0},
        "memory": {"type": "integer", "minimum": 0},
        "gpus": {"type": "integer", "minimum": 0, "maximum": 1024},
    },
}
TASK_SPEC: Schema = {
    "type": "object",
    "required": ["task_id", "kind", "actor"],
    "additionalProperties": False,
    "properties": {
        "task_id": ID,
        "kind": {"type": "string", "minLength": 1, "maxLength": 64},
        "actor": {
            "type": "string",
            "maxLength": 256,
            "pattern": r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        },
        "args": FREE_OBJECT,
        "resources": TASK_RESOURCES,
    },
}


GPU_INDICES: Schema = {
    "type": "array",
    "maxItems": 1024,
    "items": {"type": "integer", "minimum": 0, "maximum": 1023},
    "description": (
        "GPU indices on the node (absent: the lowest free ones the task asks for); rule: no "
        "index twice, none with a null node_id; each one the node registered, else 409"
    ),
}
"""The GPUs a placement gives a task on its node; the state machine checks they exist there."""

MAX_PUBLISHED_BYTES = 4096
MAX_PUBLISHED_KEYS = 32
MAX_PUBLISHED_KEY_CHARS = 64
MAX_PUBLISHED_TEXT = 1024
PUBLISHED_STATE: Schema = {
    "type": "object",
    "maxProperties": MAX_PUBLISHED_KEYS,
    "propertyNames": {"type": "string", "minLength": 1, "maxLength": MAX_PUBLISHED_KEY_CHARS},
    "additionalProperties": {
        "type": ["string", "number", "boolean", "null"],
        "maxLength": MAX_PUBLISHED_TEXT,
    },
    "description": (
        f"a flat object: text (at most {MAX_PUBLISHED_TEXT} chars), numbers, booleans or "
        f"null; rule: at most {MAX_PUBLISHED_BYTES} bytes as compact JSON"
    ),
}
"""What a task publishes: small and flat, since every heartbeat reply of its job's nodes
carries it and every replica keeps it in the Raft log."""


RESTART_POLICY: Schema = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "max_restarts": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "window_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1e9,
            "description": "the sliding window, in seconds, in which restarts are counted",
        },
        "backoff_s": {"type": "number", "minimum": 0, "maximum": 1e6},
        "backoff_max_s": {
            "type": "number",
            "minimum": 0,
            "maximum": 1e6,
            "description": "rule: at least backoff_s (the cap cannot be below the first back-off)",
        },
    },
}
"""A job's `spec.restart`: how many restarts of its tasks within `window_s` seconds the leader
makes before it fails the job (OTP-style restart intensity), and the back-off between counted
restarts (none for the first in the window, then `backoff_s` doubling up to `backoff_max_s`)."""


JOB_SPEC: Schema = {
    "type": "object",
    "description": "free-form JSON, but for `restart`, which the leader reads",
    "properties": {"restart": RESTART_POLICY},
}


def _unique_list(item: Schema, key: str, most: int) -> Schema:
    """An array whose items' `key` must differ: a rule JSON Schema cannot state, so it is
    named in the description and checked by `_check_unique`."""
    return {
        "type": "array",
        "maxItems": most,
        "items": item,
        "description": f"rule: no two items share a {key}",
    }


MAX_FAULT_DURATION_S = 3600.0
FAULT_PARAMS: Schema = {
    "duration_s": {
        "type": "number",
        "minimum": 0,
        "maximum": MAX_FAULT_DURATION_S,
        "description": "rule: > 0 for task-pause and clock-skew",
    },
    "gpu": {
        "type": "integer",
        "minimum": 0,
        "maximum": 1023,
        "description": "rule: gpu-xid only, which needs it",
    },
    "xid": {
        "type": "integer",
        "minimum": 1,
        "maximum": 1023,
        "description": "rule: gpu-xid only",
    },
    "offset_s": {
        "type": "number",
        "minimum": -MAX_FAULT_DURATION_S,
        "maximum": MAX_FAULT_DURATION_S,
        "description": "rule: clock-skew only, which needs it non-zero",
    },
}
"""The kind-specific keys of a fault: how long a pause or a skew lasts, the GPU and XID number
of a gpu-xid, a skew's offset; `validate_args` checks which kind takes which."""


def _obj(required: list[str], **props: Schema) -> Schema:
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": props,
    }


def _list_of(item: Schema, unique_by: str) -> Schema:
    return _unique_list(item, unique_by, MAX_BATCH)


# op -> schema of its args; the API's request bodies reuse these (see api.py).
ARG_SCHEMAS: dict[str, Schema] = {
    "register_node": _obj(
        ["node_id", "address", "resources"],
        node_id=ID,
        address={"type": "string", "minLength": 1, "maxLength": 256},
        resources=NODE_RESOURCES,
        labels={"type": "object", "additionalProperties": {"type": "string", "maxLength": 256}},
    ),
    "set_liveness": _obj(
        ["changes"],
        changes=_list_of(
            _obj(["node_id", "liveness"], node_id=ID, liveness={"enum": list(LIVENESS)}),
            "node_id",
        ),
    ),
    "report_health": _obj(
        ["reports"],
        reports=_list_of(
            _obj(["node_id", "health"], node_id=ID, health=FREE_OBJECT, last_heartbeat=STAMP),
            "node_id",
        ),
    ),
    "set_cordon": _obj(["node_id", "cordoned"], node_id=ID, cordoned={"type": "boolean"}),
    "set_draining": _obj(["node_id", "draining"], node_id=ID, draining={"type": "boolean"}),
    "submit_job": _obj(
        ["job_id"],
        job_id=ID,
        spec=JOB_SPEC,
        tasks=_unique_list(TASK_SPEC, "task_id", 4096),
    ),
    "stop_job": _obj(["job_id"], job_id=ID),
    "restart_tasks": _obj(
        ["job_id", "cause", "generation", "tasks", "reason", "counted"],
        job_id=ID,
        cause=ID,
        generation={"type": "integer", "minimum": 0},
        tasks={
            "type": "array",
            "maxItems": 4096,
            "items": ID,
            "description": "rule: `cause` is one of them",
        },
        reason=TEXT,
        counted={"type": "boolean"},
    ),
    "add_tasks": _obj(
        ["job_id", "tasks"],
        job_id=ID,
        tasks=_unique_list(TASK_SPEC, "task_id", 4096),
    ),
    "place_tasks": _obj(
        ["placements"],
        placements=_list_of(
            _obj(
                ["task_id", "node_id"],
                task_id=ID,
                node_id={**ID, "type": ["string", "null"]},
                gpus=GPU_INDICES,
            ),
            "task_id",
        ),
    ),
    "set_task_state": _obj(
        ["task_id", "state"],
        task_id=ID,
        state={"enum": list(TASK_STATES)},
        generation={"type": "integer", "minimum": 0},
        message=TEXT,
    ),
    "migrate_task": _obj(["task_id", "node_id"], task_id=ID, node_id=ID, gpus=GPU_INDICES),
    "publish_task_state": _obj(
        ["task_id", "generation", "state"],
        task_id=ID,
        generation={"type": "integer", "minimum": 0},
        state=PUBLISHED_STATE,
    ),
    "set_pending_reason": _obj(
        ["task_id", "generation", "reason"],
        task_id=ID,
        generation={"type": "integer", "minimum": 0},
        reason={**TEXT, "minLength": 1},
    ),
    "abandon_incoming": _obj(
        ["task_id", "generation", "reason"],
        task_id=ID,
        generation={"type": "integer", "minimum": 0},
        reason=TEXT,
    ),
    "record_checkpoint": _obj(
        ["job_id", "path", "step", "sha256", "complete"],
        job_id=ID,
        path={"type": "string", "minLength": 1, "maxLength": 1024},
        step={"type": "integer", "minimum": 0},
        sha256={"type": "string", "pattern": "^[0-9a-f]{64}$"},
        complete={"type": "boolean"},
    ),
    "add_event": _obj(
        ["kind", "message"],
        kind={"type": "string", "minLength": 1, "maxLength": 64},
        message=TEXT,
        fields=FREE_OBJECT,
    ),
    "announce_leader": _obj(
        ["replica_id", "raft", "api", "term"],
        replica_id=ID,
        raft={"type": "string", "maxLength": 256},
        api={"type": "string", "maxLength": 256},
        term={"type": "integer", "minimum": 0},
    ),
    "barrier": _obj([]),
    "inject_fault": _obj(
        ["fault_id", "kind", "target"],
        fault_id=ID,
        kind={"enum": list(FAULT_KINDS)},
        target=ID,
        **FAULT_PARAMS,
    ),
    "report_fault": _obj(
        ["fault_id", "state"],
        fault_id=ID,
        state={"enum": [s for s in FAULT_STATES if s != "requested"]},
        message=TEXT,
    ),
}

BATCH_ARGS: Schema = _obj(["commands"], commands={"type": "array", "maxItems": MAX_BATCH})
COMMAND: Schema = _obj(
    ["op", "op_id", "at", "args"],
    op={"enum": sorted([*ARG_SCHEMAS, "batch"])},
    op_id=ID,
    at=STAMP,
    args={"type": "object", "additionalProperties": True},  # checked per op by validate_args
)


def validate_args(op: str, args: Any, field: str = "args") -> None:
    """Raise `ValidationError` unless `args` are well-formed for `op` (no state is consulted)."""
    if op not in ARG_SCHEMAS:
        raise ValidationError("op", f"unknown command {op!r}; known: {sorted(ARG_SCHEMAS)}")
    check(ARG_SCHEMAS[op], args, field)
    _check_unique(op, args, field)
    if op == "submit_job":
        _check_restart_policy(args.get("spec", {}), f"{field}.spec.restart")
    if op == "inject_fault":
        check_fault_params(args, field)
    if op == "place_tasks":
        for i, placement in enumerate(args["placements"]):
            _check_gpus(placement, f"{field}.placements[{i}]")
    if op == "migrate_task":
        _check_gpus(args, field)
    if op == "publish_task_state":
        check_published_size(args["state"], f"{field}.state")
    if op == "restart_tasks" and args["cause"] not in args["tasks"]:
        raise RuleViolation(
            f"{field}.cause", f"{args['cause']!r} must be one of the tasks it restarts"
        )


def _check_gpus(placement: dict[str, Any], field: str) -> None:
    gpus = placement.get("gpus")
    if gpus is None:
        return
    if placement.get("node_id", "") is None and gpus:
        raise RuleViolation(f"{field}.gpus", "a task placed on no node holds no GPUs; drop gpus")
    if len(set(gpus)) != len(gpus):
        twice = sorted({g for g in gpus if gpus.count(g) > 1})
        raise RuleViolation(f"{field}.gpus", f"names GPU {twice[0]} twice; list each GPU once")


def check_published_size(state: dict[str, Any], field: str) -> None:
    """The one limit of a published state its schema cannot state: its compact JSON size."""
    size = len(json.dumps(state, separators=(",", ":")).encode())
    if size > MAX_PUBLISHED_BYTES:
        raise RuleViolation(
            field,
            f"is {size} bytes as compact JSON, more than {MAX_PUBLISHED_BYTES}: publish less "
            "(addresses and a few numbers; write bulk data to the task's files)",
        )


def check_fault_params(args: dict[str, Any], field: str) -> None:
    """The keys each fault kind takes: a pause and a skew need their length, gpu and xid
    belong to gpu-xid, offset_s to clock-skew."""
    kind = args["kind"]
    if kind in ("task-pause", "clock-skew") and not args.get("duration_s", 0) > 0:
        raise RuleViolation(
            f"{field}.duration_s",
            f"{kind} needs duration_s > 0 (seconds until it is undone); it would otherwise "
            "stay in place",
        )
    if kind == "gpu-xid" and "gpu" not in args:
        raise RuleViolation(f"{field}.gpu", "gpu-xid needs gpu, the index of the GPU to fault")
    if kind == "clock-skew" and not args.get("offset_s"):
        raise RuleViolation(
            f"{field}.offset_s", "clock-skew needs offset_s, the non-zero seconds to add"
        )
    for key, owner in (("gpu", "gpu-xid"), ("xid", "gpu-xid"), ("offset_s", "clock-skew")):
        if key in args and kind != owner:
            raise RuleViolation(f"{field}.{key}", f"only {owner} takes {key}; drop it for {kind}")


def _check_restart_policy(spec: dict[str, Any], field: str) -> None:
    """`spec` is free-form except its `restart` object, which the state machine reads."""
    policy = spec.get("restart")
    if policy is None:
        return
    base = policy.get("backoff_s", DEFAULT_BACKOFF_S)
    cap = policy.get("backoff_max_s", DEFAULT_BACKOFF_MAX_S)
    if cap < base:
        raise RuleViolation(
            f"{field}.backoff_max_s",
            f"is {cap} s, less than backoff_s ({base} s); the cap must be at least the first "
            "back-off: raise backoff_max_s or lower backoff_s",
        )


def _check_unique(op: str, args: dict[str, Any], field: str) -> None:
    lists = {
        "register_node": ("resources", "gpus", "index"),
        "submit_job": (None, "tasks", "task_id"),
        "add_tasks": (None, "tasks", "task_id"),
        "place_tasks": (None, "placements", "task_id"),
        "set_liveness": (None, "changes", "node_id"),
        "report_health": (None, "reports", "node_id"),
    }
    if op not in lists:
        return
    parent, name, key = lists[op]
    holder = args.get(parent, {}) if parent else args
    seen: set[Any] = set()
    for i, item in enumerate(holder.get(name, [])):
        if item[key] in seen:
            where = f"{field}.{parent}.{name}" if parent else f"{field}.{name}"
            raise RuleViolation(f"{where}[{i}].{key}", f"duplicate {key} {item[key]!r}")
        seen.add(item[key])


def validate_command(command: Any) -> None:
    """Validate a whole command (including every member of a batch) before it is proposed."""
    check(COMMAND, command, "command")
    if command["op"] == "batch":
        check(BATCH_ARGS, command["args"], "command.args")
        for i, member in enumerate(command["args"]["commands"]):
            check(COMMAND, member, f"command.args.commands[{i}]")
            if member["op"] == "batch":
                raise ValidationError(f"command.args.commands[{i}].op", "batches do not nest")
            validate_args(member["op"], member["args"], f"command.args.commands[{i}].args")
    else:
        validate_args(command["op"], command["args"], "command.args")
    size = len(json.dumps(command, separators=(",", ":")))
    if size > MAX_COMMAND_BYTES:
        raise PayloadTooLarge(
            f"the command is {size} bytes, more than {MAX_COMMAND_BYTES}: send less per "
            "request (split a batch, or a job's tasks over several add-tasks calls)"
        )


def make_command(op: str, args: dict[str, Any], op_id: str, at: float) -> dict[str, Any]:
    """Build and validate one command; raises `ValidationError` naming the bad field, or
    `PayloadTooLarge`."""
    command = {"op": op, "op_id": op_id, "at": at, "args": args}
    validate_command(command)
    return command
