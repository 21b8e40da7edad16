"""The OpenAPI 3 document, generated from the same route table that registers the handlers."""

from __future__ import annotations

from typing import Any

from shoal.raft.commands import ID
from shoal.raft.routes import Route
from shoal.version import __version__

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error", "message"],
    "properties": {
        "error": {
            "type": "string",
            "description": "machine-readable code, e.g. invalid, not_found",
        },
        "message": {"type": "string"},
        "field": {"type": ["string", "null"], "description": "the request field at fault"},
        "leader": {"type": ["string", "null"], "description": "hint when the error is not_leader"},
    },
}
_ROLE_TEXT = {
    "none": "Role: none (no token needed).",
    "read": "Role: read (the read-only, node or operator token).",
    "node": "Role: node (the node credential or the operator token).",
    "operator": "Role: operator (the operator token only).",
}
_ERRORS = {
    "400": "not JSON, nested too deep, or a bad query parameter",
    "401": "no bearer token",
    "403": "wrong bearer token, or a token whose role is below the route's (x-shoal-role)",
    "404": "unknown id",
    "409": "conflicts with the current state, or its X-Shoal-Op-Id named another command",
    "421": "needs the leader and this replica cannot reach it",
    "422": "the body does not match its schema (field named)",
    "503": "no quorum, or the replica is busy",
    "504": "not committed within the timeout; retry with the same X-Shoal-Op-Id",
}


def _operation(route: Route) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": ID} for name in route.path_params
    ]
    params += [
        {
            "name": p.name,
            "in": "query",
            "required": False,
            "schema": p.schema,
            "description": p.description,
        }
        for p in route.query
    ]
    if route.write:
        params.append(
            {
                "name": "X-Shoal-Op-Id",
                "in": "header",
                "required": False,
                "schema": ID,
                "description": (
                    "operation id of this one command: a retry with the same id and the same "
                    "command is applied once and answers the first result; the same id with "
                    "another command is a 409"
                ),
            }
        )
    error_ref = {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    }
    responses: dict[str, Any] = {"200": {"description": "success"}}
    if route.accepted:
        responses["202"] = {"description": "accepted: recorded, carried out later"}
    elif route.method == "POST" and route.write:
        responses["201"] = {"description": "created"}
    for code, text in _ERRORS.items():
        if code in ("401", "403") and not route.auth:
            continue
        responses[code] = {"description": text, **error_ref}
    if route.body is not None:
        responses["413"] = {"description": "the body is longer than the API reads", **error_ref}
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "description": _ROLE_TEXT[route.role],
        "x-shoal-role": route.role,
        "tags": [route.tag],
        "parameters": params,
        "responses": responses,
        "security": [{"bearer": []}] if route.auth else [],
    }
    if route.body is not None:
        op["requestBody"] = {
            # Without required fields, an empty body stands for `{}`.
            "required": bool(route.body.get("required")),
            "content": {"application/json": {"schema": route.body}},
        }
    return op


def build_document(routes: tuple[Route, ...]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "shoal coordinator admin API", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": ERROR_SCHEMA},
        },
    }
