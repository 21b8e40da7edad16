"""The admin HTTP API: registers `ROUTES` with aiohttp, checking the token, the query and the
body of each request against the route's declaration before its handler runs.

A `RaftError` becomes a JSON error with its status (4xx/5xx per type). Anything else is a bug and
is left to aiohttp's 500, never dressed up: the tests assert that bad input gets no 500.
"""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Any

from aiohttp import web

from shoal.boundedjson import JsonRefused, JsonTooDeep, loads
from shoal.raft.chaos_api import CHAOS_ROUTES, chaos_routes
from shoal.raft.commands import ID
from shoal.raft.config import CoordinatorConfig
from shoal.raft.context import ApiContext
from shoal.raft.dashboard import DASHBOARD_ROUTES
from shoal.raft.entry_points import check_entry_points
from shoal.raft.errors import (
    BadRequest,
    Forbidden,
    PayloadTooLarge,
    RaftError,
    Unauthorized,
    ValidationError,
)
from shoal.raft.handlers import reply
from shoal.raft.openapi import build_document
from shoal.raft.route_table import ROUTES
from shoal.raft.routes import ROLE_RANK, ROLE_TOKEN, Call, Param, Route
from shoal.raft.schema import check

COMMIT_HEADER = "X-Shoal-Commit-Index"
OP_HEADER = "X-Shoal-Op-Id"
MAX_BODY = 4 << 20
MAX_BODY_DEPTH = 64
"""A body nests a job's free-form spec a few levels down; the spec itself may nest 16."""
CONTEXT: web.AppKey[ApiContext] = web.AppKey("shoal_api_context", ApiContext)


async def openapi_document(ctx: ApiContext, call: Call) -> web.Response:
    chaos = CHAOS_ROUTES if ctx.config.chaos.enabled else ()
    return reply(build_document((*ALL_ROUTES, *chaos)))


ALL_ROUTES: tuple[Route, ...] = (
    *ROUTES,
    *DASHBOARD_ROUTES,
    Route("GET", "/openapi.json", openapi_document, "this document", tag="meta", role="read"),
)


def route_error(exc: RaftError) -> dict[str, Any]:
    """The JSON body of an error answer: code, message, and the field or leader when known."""
    return {
        "error": exc.code,
        "message": str(exc),
        "field": exc.field,
        "leader": getattr(exc, "leader", None),
    }


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization")
    if header is None:
        raise Unauthorized(
            "missing 'Authorization: Bearer <token>' header (token: run dir api-token)"
        )
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        raise Forbidden("the Authorization header must be 'Bearer <token>'")
    return given.strip()


def token_role(config: CoordinatorConfig, given: str) -> str | None:
    """The role the token `given` holds on this replica, or None when it is none of its
    tokens. Every token is compared, in constant time, so timing tells nothing."""
    role = None
    for name, token in (
        ("read", config.read_token),
        ("node", config.node_token),
        ("operator", config.token),
    ):
        if token is not None and hmac.compare_digest(given.encode(), token.encode()):
            role = name
    return role


def _check_token(request: web.Request, config: CoordinatorConfig, route: Route) -> str:
    """The role of the request's token when it includes the route's; 403 otherwise, naming
    the role needed."""
    role = token_role(config, _bearer(request))
    if role is None:
        raise Forbidden("wrong bearer token; use a token the coordinator was started with")
    if ROLE_RANK[role] < ROLE_RANK[route.role]:
        raise Forbidden(
            f"{route.method} {route.path} needs the {route.role} role and this is the {role} "
            f"token; use {ROLE_TOKEN[route.role]}"
        )
    return role


def _parse_query(params: tuple[Param, ...], request: web.Request) -> dict[str, Any]:
    known = {p.name: p for p in params}
    out: dict[str, Any] = {}
    for name, raw in request.query.items():
        param = known.get(name)
        if param is None:
            raise BadRequest(f"query.{name}: unknown parameter; known: {sorted(known)}")
        out[name] = _convert(param, raw)
    return out


def _integer(raw: str) -> int:
    """As in JSON Schema, `3.0` is the integer 3."""
    try:
        return int(raw)
    except ValueError:
        number = float(raw)
        if not number.is_integer():
            raise
        return int(number)


def _convert(param: Param, raw: str) -> Any:
    kind = param.schema.get("type")
    try:
        if kind == "integer":
            value: Any = _integer(raw)
        elif kind == "number":
            value = float(raw)
        elif kind == "boolean":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            value = raw.lower() in ("true", "1")
        else:
            value = raw
    except ValueError:
        raise BadRequest(f"query.{param.name}: {raw!r} is not a valid {kind}") from None
    try:
        check(param.schema, value, f"query.{param.name}")
    except ValidationError as exc:
        raise BadRequest(str(exc)) from None
    return value


async def _read_body(request: web.Request) -> bytes:
    too_large = PayloadTooLarge(
        f"body: more than {MAX_BODY} bytes; send less (split a batch into several)"
    )
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON, its size and depth bounded before it is parsed."""
    try:
        return loads(raw, max_bytes=MAX_BODY, max_depth=MAX_BODY_DEPTH)
    except JsonTooDeep as exc:
        raise BadRequest(f"body: {exc}; flatten the document", "body") from None
    except JsonRefused as exc:
        raise BadRequest(f"body: {exc}", "body") from None


async def _parse_body(route: Route, request: web.Request) -> Any:
    if route.body is None:
        return None
    raw = await _read_body(request)
    if raw.strip():
        body = parse_json_body(raw)
    elif route.body.get("required"):
        raise ValidationError(
            "body", f"is required: a JSON object with {', '.join(route.body['required'])}"
        )
    else:
        body = {}
    check(route.body, body, "body")
    return body


def _op_id(route: Route, request: web.Request) -> str:
    given = request.headers.get(OP_HEADER)
    if given is None or not route.write:
        return uuid.uuid4().hex
    check(ID, given, f"header.{OP_HEADER}")
    return given


def _wrap(ctx: ApiContext, route: Route) -> Any:
    label = f"{route.method} {route.path}"

    async def handle(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        commit = ctx.bridge.last_applied()
        try:
            role = _check_token(request, ctx.config, route) if route.auth else "none"
            path = dict(request.match_info)
            for name, value in path.items():
                check(ID, value, f"path.{name}")
            query = _parse_query(route.query, request)
            body = await _parse_body(route, request)
            check_entry_points(body, ctx.config.task_entry_points)
            call = Call(path, query, body, _op_id(route, request), request, role)
            response = await route.handler(ctx, call)
        except RaftError as exc:
            if exc.field == "op_id" and route.write:  # the machine's name for the header
                exc.field = f"header.{OP_HEADER}"
            response = web.json_response(route_error(exc), status=exc.http_status)
        response.headers[COMMIT_HEADER] = str(commit)
        ctx.metrics.inc(
            "shoal_api_requests_total",
            "admin API requests",
            route=label,
            status=str(response.status),
        )
        ctx.metrics.observe(
            "shoal_api_request_seconds",
            "admin API request time",
            time.perf_counter() - started,
            route=label,
        )
        return response

    handle.__name__ = route.operation_id
    return handle


def build_app(ctx: ApiContext) -> web.Application:
    """The admin API application for one replica; the caller runs and cleans it up."""
    app = web.Application(client_max_size=MAX_BODY)
    app[CONTEXT] = ctx
    for route in (*ALL_ROUTES, *chaos_routes(ctx.config.chaos.enabled)):
        app.router.add_route(route.method, route.path, _wrap(ctx, route))
    return app
