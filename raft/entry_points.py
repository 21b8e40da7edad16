"""The coordinator's allow-list of task entry points: submitting a job is running code on
every node, so a replica whose `[api] task_entry_points` is set refuses a job whose tasks name
an entry point outside it (shoal's own task kinds are always allowed; docs/security.md).
Without the key every entry point is admitted, as before the list existed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shoal.raft.errors import Forbidden

BUILTIN_PREFIX = "shoal."
"""shoal's own task kinds (learner ranks, rollout workers, process tasks) live under it."""
TASK_OPS = ("submit_job", "add_tasks")


def allowed(actor: str, prefixes: tuple[str, ...] | None) -> bool:
    """Whether `actor` (package.module:Name) starts with shoal's prefix or an allowed one;
    `prefixes` None (no list configured) admits everything."""
    if prefixes is None:
        return True
    return any(actor.startswith(p) for p in (BUILTIN_PREFIX, *prefixes))


def _actors(body: Any, field: str) -> Iterator[tuple[str, str]]:
    """(field, actor) of every task a validated submit, add-tasks or batch body names."""
    if not isinstance(body, dict):
        return
    for i, task in enumerate(body.get("tasks") or ()):
        if isinstance(task, dict) and isinstance(task.get("actor"), str):
            yield f"{field}.tasks[{i}].actor", task["actor"]
    for i, command in enumerate(body.get("commands") or ()):
        if isinstance(command, dict) and command.get("op") in TASK_OPS:
            yield from _actors(command.get("args"), f"{field}.commands[{i}].args")


def check_entry_points(body: Any, prefixes: tuple[str, ...] | None) -> None:
    """Refuse (403) a body naming a task entry point outside the allow-list, naming the entry
    point and the key that would admit it."""
    for field, actor in _actors(body, "body"):
        if not allowed(actor, prefixes):
            exc = Forbidden(
                f"{field}: entry point {actor!r} is not allowed on this cluster; add its "
                f"prefix to [api] task_entry_points in the coordinators' --config "
                f"(allowed: {[BUILTIN_PREFIX, *(prefixes or ())]})"
            )
            exc.field = field
            raise exc
