"""`shoal train` through a running cluster: the same run, its processes placed by the leader.

`ClusterRun` lays out the run directory exactly as the embedded run does (job.json,
cluster.token, checkpoints/), then submits ONE job to the coordinators whose tasks run the same
two programs, learner ranks and rollout workers, as node child processes (task kinds
`learner-rank`, which the leader gang-places, and `rollout-worker`, which it spreads), with
`spec.placement = "auto"` so the leader places them. Progress, the progress bar and the stop rule are the embedded run's, read from the
ranks' status files in the run directory (nodes here share this machine's filesystem). On
stop it asks the coordinator to stop the job, waits for the tasks to stop (rank 0 writes the
final checkpoint on SIGTERM) and records that checkpoint with the coordinator. Restarts are the
coordinator's and nodes' business, not this process's: a failed task ends the run with its
reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.train import LocalRun, TrainError, TrainResult

if TYPE_CHECKING:
    from shoal.learner.config import TrainConfig
    from shoal.raft.client import CoordinatorClient

T = TypeVar("T")
LEARNER_KIND = "learner-rank"
ROLLOUT_KIND = "rollout-worker"
LEARNER_ENTRY = "shoal.learner.learner_main:main"
ROLLOUT_ENTRY = "shoal.learner.rollout_main:main"
CHECK_TASKS_EVERY_S = 1.0
STOP_WAIT_S = 40.0
CLIENT_TIMEOUT_S = 5.0
ACTIVE = ("pending", "running")


@dataclass(frozen=True)
class Coordinators:
    """Where the cluster's API is and the file holding its bearer token."""

    urls: list[str]
    token_file: Path
    job_id: str = field(default_factory=lambda: f"train-{os.urandom(4).hex()}")

    def __post_init__(self) -> None:
        from shoal.errors import ConfigError

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


def job_tasks(
    job_id: str,
    learners: list[tuple[list[str], dict[str, str]]],
    rollouts: list[list[str]],
) -> list[dict[str, Any]]:
    """The job's task records: one per learner rank (argv after the entry point, extra env),
    then one per rollout worker; all process tasks the leader places."""
    tasks = [
        {
            "task_id": f"{job_id}-learner-{rank}",
            "kind": LEARNER_KIND,
            "actor": LEARNER_ENTRY,
            "args": {"argv": list(argv), "env": dict(env)},
        }
        for rank, (argv, env) in enumerate(learners)
    ]
    tasks += [
        {
            "task_id": f"{job_id}-rollout-{w}",
            "kind": ROLLOUT_KIND,
            "actor": ROLLOUT_ENTRY,
            "args": {"argv": list(argv), "env": {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}},
        }
        for w, argv in enumerate(rollouts)
    ]
    return tasks


def started_pids(lines: list[str], job_id: str) -> set[int]:
    """The pids of the processes that announced their start (events.jsonl lines) after job
    `job_id` was submitted; lines that are not such events are skipped."""
    pids: set[int] = set()
    after = False
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("event") == "submitted":
            after = event.get("job") == job_id
            pids.clear()
        elif after and event.get("event") == "start" and isinstance(event.get("pid"), int):
            pids.add(event["pid"])
    return pids


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def find_cluster(run_dir: Path) -> Coordinators | None:
    """The local cluster in `run_dir` if one of its coordinator replicas is alive, else None."""
    from shoal.local import LocalCluster, LocalClusterError

    local = LocalCluster(run_dir)
    if not (local.run_dir / "cluster.json").exists():
        return None
    try:
        specs = local.specs()
    except (LocalClusterError, OSError, ValueError, TypeError):
        return None
    alive = [s.api_url for s in specs if s.api_url and local.pid(s.name) is not None]
    if not alive:
        return None
    return Coordinators([s.api_url for s in specs if s.api_url], local.run_dir / "api-token")


class ClusterRun(LocalRun):
    """One training run whose processes are a coordinator job's tasks."""

    def __init__(
        self, cfg: TrainConfig, env_id: str, run_dir: Path, coordinators: Coordinators, **kw: Any
    ) -> None:
        super().__init__(cfg, env_id, run_dir.resolve(), **kw)
        self.coordinators = coordinators
        self.job_id = coordinators.job_id
        self._checked = 0.0
        self._submitted = False

    # -- talking to the coordinator ------------------------------------------------------------

    def _call(self, fn: Callable[[CoordinatorClient], Awaitable[T]]) -> T:
        from shoal.errors import ShoalError
        from shoal.raft.client import CoordinatorClient

        async def once() -> T:
            urls, token = self.coordinators.urls, self.coordinators.token
            async with CoordinatorClient(urls, token, timeout=CLIENT_TIMEOUT_S) as c:
                return await fn(c)

        try:
            return asyncio.run(once())
        except ShoalError as exc:
            if isinstance(exc, TrainError):
                raise
            raise TrainError(
                f"the coordinators {self.coordinators.urls} refused or did not answer: {exc}"
            ) from exc

    # -- hooks of the embedded run -------------------------------------------------------------

    def _job_extra(self) -> dict[str, Any]:
        return {"coordinator": self.coordinators.to_job()}

    def _child_env(self, extra: dict[str, str]) -> dict[str, str]:
        """Only what differs from the node's own environment travels in the task."""
        return {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}

    def _launch(self) -> None:
        learners = [(child.argv[3:], child.env) for child in self.learners]
        rollouts = [child.argv[3:] for child in self.rollouts]
        tasks = job_tasks(self.job_id, learners, rollouts)
        spec = {"placement": "auto", "kind": "train", "env_id": self.env_id}
        self._call(lambda c: c.submit_job(spec=spec, tasks=tasks, job_id=self.job_id))
        self._submitted = True
        from shoal.learner.learner_main import append_event

        append_event(self.run_dir, {"event": "submitted", "job": self.job_id})

    def _check_children(self) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_TASKS_EVERY_S:
            return
        self._checked = now
        job = self._call(lambda c: c.job(self.job_id))
        self.restarts = int(job.get("restarts", 0))
        if job.get("state") == "failed":
            nodes = sorted({str(t.get("node")) for t in job.get("tasks", []) if t.get("node")})
            raise TrainError(
                f"job {self.job_id} failed: {job.get('message') or '?'}; read its tasks' logs "
                f"on node(s) {', '.join(nodes) or '?'}"
            )

    def shutdown(self) -> None:
        """Stop the job (ranks get SIGTERM; rank 0 checkpoints), then wait for every task."""
        if not self._submitted:
            return
        self._call(lambda c: c.stop_job(self.job_id))
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            tasks = self._call(lambda c: c.tasks(job=self.job_id))
            if not any(t.get("state") in ACTIVE for t in tasks) and self._processes_gone():
                return
            time.sleep(0.2)
        from shoal.learner.learner_main import append_event

        # Not raised: an error that ended the run early (no rank ever started) matters more.
        append_event(self.run_dir, {"event": "stop_timeout", "job": self.job_id})

    def _processes_gone(self) -> bool:
        """The coordinator marks tasks stopped at once; the processes exit (rank 0 after its
        final checkpoint) a moment later. They run on this host: wait for their pids."""
        events = self.run_dir / "events.jsonl"
        lines = events.read_text().splitlines() if events.exists() else []
        return not any(_alive(pid) for pid in started_pids(lines, self.job_id))

    def _result(self, stopped_by: str, wall_s: float) -> TrainResult:
        result = super()._result(stopped_by, wall_s)
        result.job_id = self.job_id
        if result.checkpoint is not None:
            from shoal.train import find_checkpoint

            info = find_checkpoint(Path(result.checkpoint))
            self._call(
                lambda c: c.record_checkpoint(
                    self.job_id, str(info.path), info.step, info.sha256, True
                )
            )
        return result
