"""Errors of the control plane: one named exception per way a command, a read or a call fails.

The admin API maps each to one HTTP status (`http_status`) and the client maps the status back,
so a caller on either side of the wire catches the same type.
"""

from __future__ import annotations

from shoal.errors import ShoalError


class RaftError(ShoalError):
    """Root of the errors a user of the coordinator can see."""

    http_status = 500
    code = "internal"
    field: str | None = None
    """The request field at fault, when one is (a dotted path such as `body.resources.memory`)."""


class ValidationError(RaftError):
    """A command or request body is malformed; `field` names the offending part (dotted path)."""

    http_status = 422
    code = "invalid"
    field: str

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RuleViolation(ValidationError):
    """Each field is well-formed, but together they break a rule a JSON schema cannot state
    (ids unique within a list, a back-off cap not below the first back-off, the keys a fault
    kind takes); the OpenAPI document names each rule in the description of its schema."""

    code = "rule"


class BadRequest(RaftError):
    """The request is not even JSON (or nests too deep), or a query parameter is unusable."""

    http_status = 400
    code = "bad_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PayloadTooLarge(RaftError):
    """The request body is longer than the API reads; send less (fewer commands per batch)."""

    http_status = 413
    code = "too_large"
    field = "body"


class NotFound(RaftError):
    """No node, job, task or checkpoint has this id: check the id with the list endpoint."""

    http_status = 404
    code = "not_found"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Conflict(RaftError):
    """The command contradicts the current state (duplicate id, stale generation, cordoned node)."""

    http_status = 409
    code = "conflict"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Unauthorized(RaftError):
    """No bearer token was sent; pass the cluster's API token (run dir `api-token`)."""

    http_status = 401
    code = "unauthorized"


class Forbidden(RaftError):
    """The bearer token is wrong; use the token the coordinator was started with."""

    http_status = 403
    code = "forbidden"


class NotLeader(RaftError):
    """This replica cannot serve the request because it is not the leader; `leader` is a hint."""

    http_status = 421
    code = "not_leader"

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class NoQuorum(RaftError):
    """Fewer than a majority of replicas are reachable, so nothing can be committed; restart them."""

    http_status = 503
    code = "no_quorum"


class Busy(RaftError):
    """The replica's command queue is full; retry after a moment with the same operation id."""

    http_status = 503
    code = "busy"


class RaftTimeout(RaftError, TimeoutError):
    """No answer within the timeout; the write may or may not have been applied (retry with the
    same operation id to find out, it is applied at most once)."""

    http_status = 504
    code = "timeout"


class Unavailable(RaftError):
    """No replica answered at all: is the cluster up (`shoal status`)?"""

    http_status = 503
    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[RaftError]] = {
    cls.code: cls
    for cls in (
        ValidationError,
        RuleViolation,
        BadRequest,
        PayloadTooLarge,
        NotFound,
        Conflict,
        Unauthorized,
        Forbidden,
        NotLeader,
        NoQuorum,
        Busy,
        RaftTimeout,
        Unavailable,
    )
}
