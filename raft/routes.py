"""The admin API's route table entries: one declaration registers a handler AND documents it.

`api.py` registers each `Route` with aiohttp and validates its query and body against the
declared schemas; `openapi.py` turns the same list into the OpenAPI document, so the two can
never drift apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from shoal.raft.schema import Schema


@dataclass(frozen=True)
class Param:
    """A query parameter; its schema type (integer, number, boolean, string) drives parsing."""

    name: str
    schema: Schema
    description: str


@dataclass
class Call:
    """One parsed, validated request as a handler sees it."""

    path: dict[str, str]
    query: dict[str, Any]
    body: Any
    op_id: str
    raw: web.Request
    role: str
    """The role of the caller's token ("none" on routes that need none): what a view may show."""

    def derived_id(self, what: str, length: int = 12) -> str:
        """An id the server makes up for this request (a job id, a batch member's op id),
        derived from its operation id: a retry with the same op id makes the same id, so it
        carries the same command and is answered the first result, not refused as another."""
        return hashlib.sha256(f"{what}\0{self.op_id}".encode()).hexdigest()[:length]


Handler = Callable[[Any, Call], Awaitable[web.StreamResponse]]

Role = Literal["none", "read", "node", "operator"]
"""Who may call a route: "none" needs no token; each other role includes those before it
(operator ⊇ node ⊇ read), so a token of a higher role may call every lower-role route."""
ROLE_RANK: dict[str, int] = {"none": 0, "read": 1, "node": 2, "operator": 3}
ROLE_TOKEN: dict[str, str] = {
    "read": "the read-only token (--read-token-file, run dir read-token), or any higher one",
    "node": "the node credential (--node-token-file, run dir node-token) or the operator token",
    "operator": "the operator token (--token-file, run dir api-token)",
}
"""For the 403 answer: which token the caller should have used for a route of each role."""


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    body: Schema | None = None
    query: tuple[Param, ...] = ()
    write: bool = False
    """Writes take an `X-Shoal-Op-Id` header: a retry with the same id is applied once."""
    tag: str = "cluster"
    accepted: bool = False
    """The write answers 202: what it asks for is carried out later, by another process."""
    role: Role = field(kw_only=True)
    """The least role a bearer token must hold to call this route (docs/security.md)."""

    @property
    def auth(self) -> bool:
        return self.role != "none"

    @property
    def path_params(self) -> list[str]:
        return [part[1:-1] for part in self.path.split("/") if part.startswith("{")]

    @property
    def operation_id(self) -> str:
        return getattr(self.handler, "__name__", "handler").lstrip("_")
