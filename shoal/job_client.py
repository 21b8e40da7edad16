"""The training run's calls to the coordinators about its one job, and where they are.

`Coordinators` names a cluster's API (URLs, token file, TLS, checkpoint storage); `JobClient`
makes each call with a fresh client (the run's loop is synchronous: one `asyncio.run` per
call) and turns every refusal into a `TrainError` naming the coordinators, except the
retryable trouble `read` leaves to the run's `JobWatch` (shoal/job_watch.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.errors import ConfigError, ShoalError
from shoal.rundir import TrainError

if TYPE_CHECKING:
    from shoal.raft.client import CoordinatorClient

T = TypeVar("T")
CLIENT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Coordinators:
    """Where the cluster's API is and the file holding its bearer token."""

    urls: list[str]
    token_file: Path
    job_id: str = field(default_factory=lambda: f"train-{os.urandom(4).hex()}")
    storage: Path | None = None
    """Where checkpoints go when the cluster's nodes do not share this host's file system (a
    path every host mounts); None: they do, and the run directory is shared by every task."""
    tls_dir: Path | None = None
    """The CA (a `shoal up --hosts` cluster's tls/) its https API is checked against; None:
    `$SHOAL_TLS_DIR`'s, or the system's."""

    def client(self, timeout: float) -> CoordinatorClient:
        from shoal.raft.client import CoordinatorClient
        from shoal.runtime.tls import TlsFiles

        tls = None if self.tls_dir is None else TlsFiles(self.tls_dir)
        return CoordinatorClient(self.urls, self.token, timeout=timeout, tls=tls)

    def __post_init__(self) -> None:
        if not self.urls or not all(u.startswith(("http://", "https://")) for u in self.urls):
            raise ConfigError(f"coordinators = {self.urls!r}: give one or more http(s):// API URLs")
        if not self.token_file.is_file():
            raise ConfigError(
                f"token_file = {str(self.token_file)!r} does not exist; point it at the "
                "cluster's api-token file"
            )

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def to_job(self) -> dict[str, Any]:
        """The job.json entry rank 0 reads to post its metrics."""
        return {"urls": list(self.urls), "token_file": str(self.token_file), "job": self.job_id}


@dataclass(frozen=True)
class JobClient:
    """Calls about job `job_id` on `coordinators`."""

    coordinators: Coordinators
    job_id: str

    def call(self, fn: Callable[[CoordinatorClient], Awaitable[T]]) -> T:
        async def once() -> T:
            async with self.coordinators.client(CLIENT_TIMEOUT_S) as c:
                return await fn(c)

        try:
            return asyncio.run(once())
        except ShoalError as exc:
            if isinstance(exc, TrainError):
                raise
            raise TrainError(
                f"the coordinators {self.coordinators.urls} refused or did not answer: {exc}"
            ) from exc

    def read(self) -> dict[str, Any] | None:
        """The job through a consistent read (None: it does not exist). Retryable trouble is
        raised as itself; anything else (a bad token) ends the run as a TrainError."""
        from shoal.raft.client import RETRYABLE
        from shoal.raft.errors import NotFound

        async def once() -> dict[str, Any] | None:
            async with self.coordinators.client(CLIENT_TIMEOUT_S) as c:
                path = f"/v1/jobs/{self.job_id}"
                try:
                    return dict(await c.request("GET", path, params={"consistent": True}))
                except NotFound:
                    return None

        try:
            return asyncio.run(once())
        except RETRYABLE:
            raise
        except ShoalError as exc:
            raise TrainError(
                f"the coordinators {self.coordinators.urls} refused to show job {self.job_id}: "
                f"{exc}"
            ) from exc

    def record_checkpoint(self, info: Any) -> None:
        """Record a complete checkpoint (a CheckpointInfo) as the job's."""
        self.call(
            lambda c: c.record_checkpoint(self.job_id, str(info.path), info.step, info.sha256, True)
        )
