"""The training run: ONE coordinator job whose tasks are the learner ranks and rollout workers.

`ClusterRun` lays out the run directory (job.json, checkpoints/), then submits
one job to the coordinators whose tasks run two programs as node child processes: learner
ranks (kind `learner-rank`, which the leader gang-places) and rollout workers
(`rollout-worker`, which it spreads), with `spec.placement = "auto"` so the leader places them
and `spec.restart` so it restarts what fails (a failed rank restarts its whole group, which
resumes from the newest complete checkpoint). Progress, the progress bar and the stop rule
come from the ranks' status files in the run directory (the nodes share this machine's file
system). The job's state is read through a consistent read once a second; a lone bad answer
(a restarted replica replaying its log, no leader for a moment) never ends the run, only
`JobWatch.needed` consecutive ones, or a minute without any answer. On stop it asks the
coordinator to stop the job, waits for the tasks to stop (rank 0 writes the final checkpoint
on SIGTERM) and records that checkpoint with the coordinator. The coordinators are those of a
`shoal up` cluster, or of the embedded one `train` starts.

This module is the loop; the rules it applies (restart policy, when the job's answers end
the run, when its processes are gone) are shoal/job_watch.py, its calls to the coordinators
shoal/job_client.py, the run directory's files shoal/rundir.py and the ranks' reports
shoal/run_status.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.job_client import Coordinators, JobClient
from shoal.job_watch import (
    RESTART_WINDOW_S,
    JobWatch,
    RestartPolicy,
    alive,
    exit_reason,
    started_pids,
)
from shoal.learning_curves import LearningCurves
from shoal.raft.model import LEARNER_KIND, ROLLOUT_KIND
from shoal.run_status import RunStatus, TrainResult, find_checkpoint
from shoal.rundir import RunDir, TrainError

if TYPE_CHECKING:
    from shoal.learner.config import TrainConfig
    from shoal.local import LocalCluster
    from shoal.progress import ProgressLine

LEARNER_ENTRY = "shoal.learner.learner_main:main"
ROLLOUT_ENTRY = "shoal.learner.rollout_main:main"
POLL_S = 0.05
CHECK_TASKS_EVERY_S = 1.0
STOP_WAIT_S = 40.0
# How long a coordinator of the embedded cluster that stopped answering during the stop may take
# to exit before the refusal itself is the error reported.
GONE_WAIT_S = 5.0
ACTIVE = ("pending", "running")
REMOTE_POLL_S = 0.25
REFUSED_PATIENCE_S = 10.0


def with_storage(cfg: TrainConfig, storage: Path | None, run_dir: Path) -> TrainConfig:
    """`cfg` with its checkpoints in `storage` (under the run's name, so rerunning the same
    run directory resumes) unless the job names a storage itself or there is none."""
    if storage is None or cfg.checkpoint.storage:
        return cfg
    place = str(storage / run_dir.name / "checkpoints")
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, storage=place))


def job_tasks(
    job_id: str,
    learners: list[tuple[list[str], dict[str, str]]],
    rollouts: list[tuple[list[str], dict[str, str]]],
    learner_resources: dict[str, Any],
    rollout_resources: dict[str, Any],
) -> list[dict[str, Any]]:
    """The job's task records: one per learner rank (argv after the entry point, extra env),
    then one per rollout worker; all process tasks the leader places with the resources
    each asks for."""
    tasks = [
        {
            "task_id": f"{job_id}-learner-{rank}",
            "kind": LEARNER_KIND,
            "actor": LEARNER_ENTRY,
            "args": {"argv": list(argv), "env": dict(env)},
            "resources": dict(learner_resources),
        }
        for rank, (argv, env) in enumerate(learners)
    ]
    tasks += [
        {
            "task_id": f"{job_id}-rollout-{w}",
            "kind": ROLLOUT_KIND,
            "actor": ROLLOUT_ENTRY,
            "args": {"argv": list(argv), "env": dict(env)},
            "resources": dict(rollout_resources),
        }
        for w, (argv, env) in enumerate(rollouts)
    ]
    return tasks


def _published_error(task: dict[str, Any]) -> str | None:
    """The `error` a task published (a configuration its restarts cannot fix), if any."""
    published = task.get("published")
    error = published.get("error") if isinstance(published, dict) else None
    return error if isinstance(error, str) and error else None


def find_cluster(run_dir: Path) -> Coordinators | None:
    """The local cluster in `run_dir` if one of its coordinator replicas is alive, else None."""
    from shoal.local import LocalCluster, LocalClusterError

    local = LocalCluster(run_dir)
    if not RunDir(local.run_dir).cluster_record.exists():
        return None
    try:
        specs = local.specs()
    except (LocalClusterError, OSError, ValueError, TypeError):
        return None
    alive = [s.api_url for s in specs if s.api_url and local.pid(s.name) is not None]
    if not alive:
        return None
    urls = [s.api_url for s in specs if s.api_url]
    return Coordinators(
        urls,
        RunDir(local.run_dir).api_token,
        storage=cluster_storage(local.run_dir),
        tls_dir=local.tls_dir,
    )


def cluster_storage(run_dir: Path) -> Path | None:
    """The checkpoint storage of a local cluster whose nodes are hosts of their own (`shoal up
    --hosts`): the directory standing for the file system every host mounts. None for a
    cluster whose nodes share this host's file system."""
    try:
        data = json.loads(RunDir(run_dir).cluster_record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("network") or not data.get("storage"):
        return None
    return Path(str(data["storage"]))


class ClusterRun:
    """One training run; `run()` blocks until it is over and every task has stopped."""

    def __init__(
        self,
        cfg: TrainConfig,
        env_id: str,
        run_dir: Path,
        coordinators: Coordinators,
        *,
        progress: ProgressLine | None = None,
        max_restarts: int = 5,
        restart_window_s: float = RESTART_WINDOW_S,
        on_poll: Callable[[ClusterRun], None] | None = None,
        embedded: LocalCluster | None = None,
    ) -> None:
        self.run_dir = run_dir.resolve()
        self.dir = RunDir(self.run_dir)
        self.coordinators = coordinators
        self.cfg = with_storage(cfg, coordinators.storage, self.run_dir)
        self.env_id = env_id
        self.job_id = coordinators.job_id
        self.restart = RestartPolicy(max_restarts, restart_window_s)
        self.on_poll = on_poll
        self.embedded = embedded
        self.status = RunStatus(self.cfg, env_id, self.run_dir, progress)
        self.curves = LearningCurves(self.run_dir)
        self.restarts = 0
        self._checked = 0.0
        self._submitted = False
        self._watch = JobWatch()
        self._recorded: str | None = None
        self._record_tried = 0.0
        self._metrics_posted = -math.inf
        self._refused_since: float | None = None
        self._jobs = JobClient(coordinators, self.job_id)
        self._token = secrets.token_hex(32)
        """The job's transport token: every task's links are authenticated with it."""

    # -- the job -------------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        """Whether every task shares this run directory (nodes on this host's file system)."""
        return self.coordinators.storage is None

    def _lay_out(self) -> list[dict[str, Any]]:
        """Write job.json (a record) and return the job's task records: every task gets the
        job as its `--job` argument and the job's transport token in its environment, and
        finds its peers through the coordinators (no port is chosen here)."""
        from shoal.learner.group import GroupSpec
        from shoal.learner.job import TOKEN_VARIABLE, job_argument

        cfg = self.cfg
        coordinator = self.coordinators.to_job() if self.shared else None
        record = {"env_id": self.env_id, "config": dataclasses.asdict(cfg), "job": self.job_id}
        self.dir.write_job_record(record)
        self.dir.clear_statuses()
        where = ["--run-dir", str(self.run_dir)] if self.shared else []
        argv = job_argument(cfg, self.env_id, coordinator) + where
        base = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", TOKEN_VARIABLE: self._token}
        learners = []
        for rank in range(cfg.learner.ranks):
            group = GroupSpec(rank, cfg.learner.ranks, backend=cfg.learner.backend)
            learners.append((argv, {**base, **group.to_env()}))
        rollouts = [([*argv, "--worker", str(w)], base) for w in range(cfg.rollout.workers)]
        learner = {"cpus": cfg.learner.cpus_per_rank, "gpus": cfg.learner.gpus_per_rank}
        rollout = {"cpus": cfg.rollout.cpus_per_worker}
        return job_tasks(self.job_id, learners, rollouts, learner, rollout)

    def _submit(self, tasks: list[dict[str, Any]]) -> None:
        spec = {
            "placement": "auto",
            "kind": "train",
            "env_id": self.env_id,
            "restart": self.restart.to_spec(),
        }
        self.dir.append_event({"event": "submitted", "job": self.job_id})
        self._submitted = True  # a reply lost after the write still leaves a job to stop
        self._jobs.call(lambda c: c.submit_job(spec=spec, tasks=tasks, job_id=self.job_id))

    def _embedded_exited(self) -> str | None:
        """The name of an embedded cluster's process that is no longer running, if any."""
        if self.embedded is None:
            return None
        specs = self.embedded.specs()
        return next((s.name for s in specs if self.embedded.pid(s.name) is None), None)

    def _check_cluster(self) -> None:
        """An embedded cluster's process that died ends the run (see `_cluster_death`)."""
        death = self._cluster_death()
        if death is not None:
            raise death

    def _cluster_death(self) -> TrainError | None:
        """An embedded cluster's process that died, in one line: its log, why it stopped, and
        the newest complete checkpoint that a rerun would resume from."""
        name = self._embedded_exited()
        if name is None or self.embedded is None:
            return None
        why = exit_reason(self.embedded.tail(name, 15), self.run_dir)
        kept = self.status.complete_checkpoint()
        resume = "" if kept is None else f"; the newest complete checkpoint is {kept.path}"
        return TrainError(
            f"{name} of the embedded cluster exited; see {self.embedded.log_path(name)}: "
            f"{why}{resume}"
        )

    def _embedded_gone_by(self, deadline: float) -> bool:
        """Whether a process of the embedded cluster has exited, or does by `deadline` (one
        that stopped answering may still be on its way out)."""
        while self._embedded_exited() is None:
            if self.embedded is None or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    # -- the run -------------------------------------------------------------------------------

    def run(self, started: float | None = None) -> TrainResult:
        """Submit, watch and stop the job; `started` (time.monotonic()) is when the run began
        (before its cluster started, for an embedded one). Ctrl-C is an orderly stop."""
        tasks = self._lay_out()
        started = time.monotonic() if started is None else started
        self.dir.append_event({"event": "run", "pid": os.getpid(), "env_id": self.env_id})
        stopped_by = "error"
        solve_s = stop_return = startup_s = None
        try:
            self._submit(tasks)
            while True:
                time.sleep(POLL_S)
                self._check_cluster()
                self._check_children()
                if self.shared:
                    self.status.read()
                self._record_new_checkpoint()
                elapsed = time.monotonic() - started
                if startup_s is None and self.status.version() > 0:
                    startup_s = elapsed
                self.status.draw(elapsed)
                self.curves.record(elapsed, self.status)
                if self.on_poll is not None:
                    self.on_poll(self)
                reason = self.status.stop_reason(elapsed)
                if reason is not None:
                    if reason == "target":
                        solve_s, stop_return = elapsed, self.status.recent_return()
                    stopped_by = reason
                    break
        except KeyboardInterrupt:
            stopped_by = "interrupted"
        except BaseException:
            self.curves.close()
            with contextlib.suppress(TrainError):  # the first error is the one to report
                self._stop_in_order()
            raise
        self._stop_in_order()
        if self.shared:
            self.status.read()
        wall_s = time.monotonic() - started
        self.curves.record(wall_s, self.status)
        self.curves.close()
        return self._result(self.status.result(stopped_by, wall_s, solve_s, stop_return, startup_s))

    def _stop_in_order(self) -> None:
        """The run is ending: a SIGTERM now (an operator, systemd, a scheduler's time limit)
        asks for what is already under way, and must not cut the stop short, leaving tasks
        running and the last checkpoint unrecorded. Ctrl-C still interrupts."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.shutdown()

    def _check_children(self) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_TASKS_EVERY_S and not self._watch.doubtful:
            return
        self._checked = now
        from shoal.raft.client import RETRYABLE

        try:
            job = self._jobs.read()
        except RETRYABLE as exc:
            reason = self._watch.silence(str(exc), now)
        else:
            if job is not None:
                self.restarts = int(job.get("restarts", 0))
                self._take(job)
            reason = self._watch.answer(self.job_id, job, now)
        if reason is not None:
            raise TrainError(reason)

    def _take(self, job: dict[str, Any]) -> None:
        """What the job's record says beyond its state: a task the leader cannot place (more
        GPUs than any island holds, say) ends the run with the leader's reason once that has
        stood for REFUSED_PATIENCE_S (nodes still registering leave a first round with
        none to place on); a task that published an `error` (a rollout worker whose fragments
        cannot be sent, see learner/rollout.py) ends the run with it, since restarting it
        would fail the same way; rank 0's
        published progress is the run's status when its files are out of reach."""
        tasks = [t for t in job.get("tasks", []) if isinstance(t, dict)]
        refused = [t for t in tasks if t.get("state") == "pending" and t.get("pending_reason")]
        now = time.monotonic()
        if not refused:
            self._refused_since = None
        elif self._refused_since is None:
            self._refused_since = now
        if refused and now - (self._refused_since or now) >= REFUSED_PATIENCE_S:
            first = refused[0]
            raise TrainError(
                f"the coordinators cannot place task {first.get('id')}: "
                f"{first['pending_reason']}; ask for fewer resources (--gpus-per-rank, "
                "--ranks) or add nodes that have them"
            )
        failed = next((t for t in tasks if _published_error(t)), None)
        if failed is not None:
            raise TrainError(f"task {failed.get('id')} cannot go on: {_published_error(failed)}")
        lead = next((t for t in tasks if t.get("id") == f"{self.job_id}-learner-0"), None)
        published = None if lead is None else lead.get("published")
        if not self.shared and isinstance(published, dict) and published:
            self.status.take_published(published)
            self._post_metrics()

    def record_report(self, result: TrainResult) -> None:
        """Post the evaluation as an `evaluation` event (the dashboard links its report), so
        the cluster's users find it where they find the job. A failed post is only lost."""
        fields = {
            "job": self.job_id,
            "report": result.report_html,
            "report_json": result.report,
            "mean_return": result.eval_mean_return,
            "checkpoint": result.checkpoint,
        }
        what = f"{self.job_id} evaluated: mean return {result.eval_mean_return:.1f}"
        with contextlib.suppress(TrainError):
            self._jobs.call(lambda c: c.add_event("evaluation", what, fields))

    def _post_metrics(self) -> None:
        """Post rank 0's published progress as the dashboard's `job_metrics` event (rank 0
        posts them itself only where it can read the operator's token, on this host)."""
        from shoal.learner.job_metrics import METRICS_KIND, POST_EVERY_S, metrics_fields

        now = time.monotonic()
        if now - self._metrics_posted < POST_EVERY_S:
            return
        self._metrics_posted = now
        lead = dict(self.status.statuses[0].record)
        fields = metrics_fields(self.job_id, lead, self.cfg.target_window)
        what = f"{self.job_id} step {fields['step']}"
        with contextlib.suppress(TrainError):  # a lost point never ends the run
            self._jobs.call(lambda c: c.add_event(METRICS_KIND, what, fields))

    def _record_new_checkpoint(self) -> None:
        """Record rank 0's newest complete checkpoint with the coordinator as it appears: the
        balancer moves a learner group only at a checkpoint boundary it knows of (after an
        XID drain, say). Once per new checkpoint; a failed try is retried a second later, and
        a coordinator that does not answer never ends the run here (`_check_children` does)."""
        lead = self.status.statuses.get(0)
        path = None if lead is None else lead.checkpoint
        now = time.monotonic()
        if not isinstance(path, str) or path == self._recorded:
            return
        if now - self._record_tried < CHECK_TASKS_EVERY_S:
            return
        self._record_tried = now
        try:
            info = find_checkpoint(Path(path))
        except TrainError:
            return  # pruned already, or not complete: a newer one follows
        try:
            self._jobs.record_checkpoint(info)
        except TrainError:
            return
        self._recorded = path

    def shutdown(self) -> None:
        """Stop the job (ranks get SIGTERM; rank 0 checkpoints), then wait for every task.
        With a broken embedded cluster there is no one to ask: its processes are stopped (a
        node still alive drains its tasks; those of a dead one got SIGTERM when it died)."""
        if not self._submitted:
            return
        deadline = time.monotonic() + STOP_WAIT_S
        if self._embedded_exited() is not None:
            self._stop_embedded(deadline)
            return
        try:
            self._stop_through_coordinators(deadline)
        except TrainError as exc:
            # The embedded cluster died while being asked (its disk filled, say): why it died
            # is the error to report, not that it no longer answers.
            if not self._embedded_gone_by(time.monotonic() + GONE_WAIT_S):
                raise
            self._stop_embedded(deadline)
            raise (self._cluster_death() or exc) from exc

    def _stop_embedded(self, deadline: float) -> None:
        """With a broken embedded cluster there is no one to ask: stop its processes."""
        if self.embedded is not None:
            self.embedded.stop_all()
        while time.monotonic() < deadline and not self._processes_gone():
            time.sleep(POLL_S)

    def _stop_through_coordinators(self, deadline: float) -> None:
        self._jobs.call(lambda c: c.stop_job(self.job_id))
        while time.monotonic() < deadline and not self._processes_gone():
            time.sleep(POLL_S)
        while time.monotonic() < deadline:
            tasks = self._jobs.call(lambda c: c.tasks(job=self.job_id))
            if not any(t.get("state") in ACTIVE for t in tasks):
                return
            time.sleep(POLL_S)
        # Not raised: an error that ended the run early (no rank ever started) matters more.
        self.dir.append_event({"event": "stop_timeout", "job": self.job_id})

    def _processes_gone(self) -> bool:
        """The coordinator marks tasks stopped at once; the processes exit (rank 0 after its
        final checkpoint) a moment later. On this host: wait for their pids. Elsewhere: wait
        for rank 0's last publication (`final`, naming its final checkpoint), which its node
        forwards once the process has exited, or for rank 0 to have failed."""
        if not self.shared:
            time.sleep(REMOTE_POLL_S)
            job = self._jobs.call(lambda c: c.job(self.job_id))
            tasks: list[dict[str, Any]] = job.get("tasks", [])
            lead = next((t for t in tasks if t.get("id") == f"{self.job_id}-learner-0"), {})
            published = lead.get("published") or {}
            if published:
                self.status.take_published(published)
            never_ran = not published and lead.get("state") not in ACTIVE
            return bool(published.get("final")) or lead.get("state") == "failed" or never_ran
        events = self.dir.events
        lines = events.read_text().splitlines() if events.exists() else []
        return not any(alive(pid) for pid in started_pids(lines, self.job_id))

    def _result(self, result: TrainResult) -> TrainResult:
        """The summary with the job's id, restarts and cluster; its checkpoint recorded."""
        result.job_id = self.job_id
        job = self._jobs.call(lambda c: c.job(self.job_id))
        result.restarts = int(job.get("restarts", self.restarts))
        result.cluster = {"coordinators": list(self.coordinators.urls), "embedded": False}
        if self.embedded is not None:
            result.cluster = {
                "coordinators": list(self.coordinators.urls),
                "embedded": True,
                "logs": str(RunDir(self.embedded.run_dir).logs),
                "task_logs": [
                    str(self.embedded.run_dir / "data" / s.name / "tasks")
                    for s in self.embedded.specs()
                    if s.kind == "node"
                ],
            }
        if result.checkpoint is not None:
            info = find_checkpoint(Path(result.checkpoint))
            self._jobs.record_checkpoint(info)
        return result
