"""Where a job's learner ranks are, as their task state in the coordinators says.

A learner rank publishes (shoal/task_exchange.py) its role, rank, transport address and epoch
(its task generation); rank 0 adds the rendezvous address of its group's store and, when
nobody shares its run directory, its progress. The node daemon forwards that to the Raft log
and shows every task the job's publications (peers.json). Nothing here picks a port in
advance or assumes a shared file system: a group restarted on other hosts is found at its new
addresses by the same lookups.
"""

from __future__ import annotations

import time
from typing import Any

from shoal.learner.group import GroupError
from shoal.task_exchange import publish, read_peers, wait_for_peer

LEARNER_NAME = "learner"
"""The name of the actor every learner rank serves on its transport."""
LEARNER_ROLE = "learner"
MAX_ERROR_CHARS = 1000
"""The longest `error` a task publishes (its task state is in every coordinator's log)."""


class Publication:
    """This task's published state: keys set over time, the whole object published each time
    (a publication replaces the previous one)."""

    def __init__(self, **fields: Any) -> None:
        self.fields: dict[str, Any] = dict(fields)

    def update(self, **fields: Any) -> bool:
        """Set `fields` and publish; False when no node daemon started this process."""
        self.fields.update(fields)
        return publish(self.fields)

    def fail(self, error: str) -> bool:
        """Publish `error`, a reason no restart of this task can fix: the job's driver ends the
        job with it (shoal/cluster_train.py) instead of restarting the task again and again.
        False when no node daemon started this process."""
        return self.update(error=error[:MAX_ERROR_CHARS])


def _is_rank(peer: dict[str, Any], rank: int) -> bool:
    published = peer["published"]
    return published.get("role") == LEARNER_ROLE and published.get("rank") == rank


class PublishedRendezvous:
    """The group's rendezvous through the coordinators (see `learner.group.Rendezvous`)."""

    def __init__(self, publication: Publication, epoch: str) -> None:
        self.publication = publication
        self.epoch = epoch

    def announce(self, addr: str, port: int) -> None:
        self.publication.update(rendezvous=f"{addr}:{port}")

    def locate(self, timeout_s: float) -> tuple[str, int]:
        deadline = time.monotonic() + timeout_s

        def match(peer: dict[str, Any]) -> bool:
            published = peer["published"]
            return (
                _is_rank(peer, 0)
                and str(published.get("epoch")) == self.epoch
                and isinstance(published.get("rendezvous"), str)
            )

        found = wait_for_peer(match, lambda: time.monotonic() >= deadline)
        if found is None:
            raise GroupError(
                f"rank 0 of epoch {self.epoch!r} published no rendezvous address within "
                f"{timeout_s:.0f} s; is it running? (its node's log and the job's tasks say)"
            )
        host, _, port = str(found["published"]["rendezvous"]).rpartition(":")
        if not host or not port.isdigit():
            raise GroupError(f"rank 0 published a malformed rendezvous address {host}:{port}")
        return host, int(port)


def learner_address(rank: int) -> str | None:
    """The transport address that learner rank `rank` of this job last published (its newest
    generation), or None while none is known."""
    newest: dict[str, Any] | None = None
    for peer in read_peers():
        if _is_rank(peer, rank) and (newest is None or peer["generation"] > newest["generation"]):
            newest = peer
    address = None if newest is None else newest["published"].get("address")
    return address if isinstance(address, str) else None
