"""link-* faults of a chaos run: the scenario's target (`all`, a learner rank `rankN`, a rollout
worker `wN`) turned into the process ids whose links the relay faults, read from the job's own
start events at injection time (a process restarted later is a new pid, left alone)."""

from __future__ import annotations

import asyncio

from shoal.chaos.errors import ProxyError
from shoal.chaos.job_process import ClusterJob
from shoal.chaos.relay import LinkRelay
from shoal.chaos.scenario import FaultSpec
from shoal.chaos.traffic import NetFaults


class LinkFaults:
    """Injects and heals link-* faults on `relay` for the processes of `job`."""

    def __init__(self, relay: LinkRelay, job: ClusterJob) -> None:
        self.relay = relay
        self.job = job

    async def _pids(self, target: str) -> tuple[list[int] | None, str]:
        """The pids a target names (None: every link) and how to say so."""
        if target == "all":
            return None, "every rollout<->learner link"
        if target.startswith("rank"):
            pid = await asyncio.to_thread(self.job.learner_pid, int(target.removeprefix("rank")))
            return [pid], f"the links of learner {target} (pid {pid})"
        pid = await asyncio.to_thread(self.job.rollout_pid, int(target.removeprefix("w")))
        return [pid], f"the links of rollout worker {target} (pid {pid})"

    async def inject(self, spec: FaultSpec) -> str:
        pids, what = await self._pids(spec.target)
        if spec.kind == "link-reset":
            return f"reset {self.relay.reset(pids)} open links: {what}"
        faults = spec.net_faults()
        hit = self.relay.inject(_name(spec), faults, pids)
        default = NetFaults().to_dict()
        shown = {k: v for k, v in faults.to_dict().items() if v != default[k]}
        return f"{shown} on {what} ({hit} open now, new ones too)"

    async def heal(self, spec: FaultSpec) -> str:
        if spec.kind == "link-reset":
            return "nothing to heal (the links were cut once)"
        try:
            hit = self.relay.heal(_name(spec))
        except ProxyError:  # its injection failed (the target was not running): nothing to lift
            return f"link fault {spec.kind} on {spec.target} was never in place"
        return f"link fault {spec.kind} on {spec.target} lifted ({hit} links hit in all)"


def _name(spec: FaultSpec) -> str:
    return f"{spec.kind}@{spec.at:g}:{spec.target}"
