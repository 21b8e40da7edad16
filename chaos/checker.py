"""The checks at the end of a chaos run: what the run observed (`Observations`, filled in by
chaos/runner.py while the faults ran), the scenario's invariants evaluated over it
(chaos/invariants.py), and the run report (chaos/report.py).

For the faults that hit the training job, recovery is the time until the job trains again,
read off the curve of rank 0's status (for a fault on the learners' node, the later of that and
the node's own probe); it counts as recovered within `duration + recover_within_s`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from shoal.chaos import invariants
from shoal.chaos.harness import Harness
from shoal.chaos.history import HistoryRecorder
from shoal.chaos.report import FaultRecord, RunReport
from shoal.chaos.scenario import COORD_KINDS, LINK_KINDS, MOVE_KINDS, TRAINING_KINDS
from shoal.chaos.workload import CheckpointLog, WorkloadStats, newest_checkpoint

CONVERGE_TIMEOUT = 30.0
EXIT_GRACE_S = 30.0
"""How long processes told to stop may take to exit before they count as left behind: a task
whose node daemon stopped it is still flushing and closing on a loaded machine."""
# Faults after which training must come from a new learner incarnation (the old one is dead).
GROUP_RESTARTING = ("learner-kill", "node-kill", "host-kill", *MOVE_KINDS)
# Faults on the training job itself: their recovery is training again, read off the curve.
JOB_KINDS = TRAINING_KINDS + LINK_KINDS
# Faults on a host's network: the node stays alive; their recovery is training again too.
HOST_NET_KINDS = ("host-cut", "host-delay")
# Faults on the learners' node: their recovery is the job's too.
LEARNER_NODE_KINDS = ("node-kill", "gpu-xid", "host-kill", *COORD_KINDS, *MOVE_KINDS)


@dataclass
class Observations:
    """What one run saw: its faults, the client workload's history, the checkpoints."""

    records: list[FaultRecord] = field(default_factory=list)
    hits_group: set[int] = field(default_factory=set)
    """Indices of the faults that hit the node the learner ranks ran on."""
    history: HistoryRecorder = field(default_factory=HistoryRecorder)
    stats: WorkloadStats = field(default_factory=WorkloadStats)
    checkpoints: CheckpointLog = field(default_factory=CheckpointLog)
    stored_steps: list[int] = field(default_factory=list)
    """The job's newest complete checkpoint in its storage, as sampled during the run."""

    def kills_learners(self, index: int) -> bool:
        """Whether fault `index` killed the learner ranks (a learner kill, or a kill of the
        node they ran on): training must then come from a new incarnation."""
        kind = self.records[index].kind
        return kind == "learner-kill" or (kind in GROUP_RESTARTING and index in self.hits_group)

    def injected(self) -> list[FaultRecord]:
        return [r for r in self.records if r.injected_at is not None]


class Checker:
    """Evaluates the scenario's invariants over `seen` and the cluster `harness` still runs."""

    def __init__(self, harness: Harness, seen: Observations) -> None:
        self.harness, self.seen = harness, seen

    def measure_progress(self) -> None:
        """Each injected fault's time until training progressed again, so far."""
        if self.harness.jobfaults is not None:
            self.harness.jobfaults.measure_progress(self.seen.records, self.seen.kills_learners)

    def progress_pending(self) -> bool:
        self.measure_progress()
        return any(r.progress_s is None for r in self.seen.injected())

    async def stop_job(self) -> dict[str, invariants.Verdict]:
        """Stop the training job in order and check what it recorded across all its learner
        incarnations; each fault's recovery of training is read off the curve."""
        job = self.harness.job
        if job is None:
            return {}
        self.harness.log("stopping the training job")
        await asyncio.to_thread(job.stop)
        records = self.seen.records
        restarted = any(
            r.injected_at is not None and self.seen.kills_learners(i) for i, r in enumerate(records)
        )
        results = await asyncio.to_thread(job.verdicts, restarted)
        self._measure_training()
        results["training_progress"] = invariants.training_progress(
            [
                {
                    "kind": r.kind,
                    "target": r.target,
                    "progress_s": r.progress_s,
                    "bound_s": r.bound_s if r.held_to_s is None else r.held_to_s,
                    "masked_by": r.masked_by,
                }
                for r in self.seen.injected()
            ]
        )
        return results

    def _measure_training(self) -> None:
        """Once, at the end: for the faults that hit the job, training's recovery is theirs
        (for a node fault, the later of it and the node's own recovery check)."""
        self.measure_progress()
        for i, record in enumerate(self.seen.records):
            if record.injected_at is None:
                continue
            if record.kind in JOB_KINDS + HOST_NET_KINDS or i in self.seen.hits_group:
                probe = record.recovery_s if record.kind not in JOB_KINDS else 0.0
                record.recovery_s = (
                    None
                    if record.progress_s is None or probe is None
                    else max(probe, record.progress_s)
                )
                bound = record.bound_s if record.held_to_s is None else record.held_to_s
                record.recovered = record.recovery_s is not None and record.recovery_s <= bound

    async def check_cluster(self) -> dict[str, invariants.Verdict]:
        wanted = self.harness.scenario.invariants
        results: dict[str, invariants.Verdict] = {}
        if "linearizable" in wanted:
            results["linearizable"] = await asyncio.to_thread(
                invariants.linearizable, self.seen.history.operations()
            )
        if "digests_equal" in wanted:
            results["digests_equal"] = await self._converged()
        if "checkpoints_forward" in wanted:
            results["checkpoints_forward"] = await self._checkpoints_forward()
        if "nodes_alive" in wanted:
            results["nodes_alive"] = await self.harness.nodes_alive(30.0)
        if "recovered" in wanted:
            results["recovered"] = invariants.recovered([asdict(r) for r in self.seen.records])
        return results

    async def _checkpoints_forward(self) -> invariants.Verdict:
        async with self.harness.client() as client:
            final = await newest_checkpoint(client)
        seen = self.seen.checkpoints
        verdict = invariants.checkpoints_forward(seen.acknowledged, seen.observed, final)
        job = self.harness.job
        if job is None:
            return verdict
        stored = await asyncio.to_thread(job.checkpoints_forward, self.seen.stored_steps)
        return invariants.both(verdict, stored, "the training job's")

    async def _converged(self) -> invariants.Verdict:
        """Replicas keep applying the leader's own writes (liveness, health), so poll until
        one round of views agrees."""
        deadline = time.monotonic() + CONVERGE_TIMEOUT
        verdict = invariants.Verdict(False, "no views")
        while time.monotonic() < deadline:
            verdict = invariants.digests_equal(await asyncio.to_thread(self.harness.views, True))
            if verdict.held:
                return verdict
            await asyncio.sleep(0.2)
        return verdict

    def no_leaks(self, ports: list[tuple[str, int]]) -> invariants.Verdict:
        """After everything stopped: no process of the run alive, none of its ports bound
        (processes still exiting get EXIT_GRACE_S)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        processes = invariants.leaked_processes(self.harness.run_dir)
        while processes and time.monotonic() < deadline:
            time.sleep(0.2)
            processes = invariants.leaked_processes(self.harness.run_dir)
        busy = [
            port
            for host in dict.fromkeys(h for h, _ in ports)
            for port in invariants.busy_ports([p for h, p in ports if h == host], host)
        ]
        return invariants.no_leaks(processes, busy)

    def report(self, results: dict[str, invariants.Verdict]) -> RunReport:
        scenario, seen = self.harness.scenario, self.seen
        jobfaults = self.harness.jobfaults
        return RunReport(
            scenario=scenario.name,
            run_dir=str(self.harness.run_dir),
            faults=seen.records,
            invariants={k: results[k] for k in scenario.invariants if k in results},
            operations=len(seen.history.operations()),
            workload={
                "acknowledged": seen.stats.acknowledged,
                "unknown_outcome": seen.stats.unknown,
                "refused": seen.stats.refused,
                "checkpoints_acknowledged": len(seen.checkpoints.acknowledged),
                "sample_errors": seen.stats.errors[:5],
            },
            training={} if jobfaults is None else jobfaults.section(),
        )
