"""Errors of the scheduler: bad topology or task input, a refused placement, a broken collector.

Each names what to change, so the coordinator can post it to /v1/events and the CLI can print it
as one line.
"""

from shoal.errors import ShoalError


class SchedulerError(ShoalError):
    """Root of the errors the scheduler and its health collectors raise."""


class TopologyError(SchedulerError):
    """The cluster description or the current placements contradict themselves (unknown node,
    a GPU used twice, duplicate names)."""


class PlacementRefused(SchedulerError):
    """A task cannot be placed now; the message says what it needs and what is free."""

    def __init__(self, task: str, reason: str) -> None:
        super().__init__(reason)
        self.task = task
        self.reason = reason


class HealthError(SchedulerError):
    """A health source answered with something that cannot be parsed, or was misconfigured."""
