"""What applying a command returns: every handler of the state machine (raft/machine.py and
the handler modules it dispatches to) answers with `ok(...)` or `refused(...)`, one shape that
the API turns into its response and that replicas compare."""

from __future__ import annotations

from typing import Any

Result = dict[str, Any]


def ok(**fields: Any) -> Result:
    return {"ok": True, **fields}


def refused(error: str, message: str, field: str | None = None) -> Result:
    return {"ok": False, "error": error, "message": message, "field": field}
