"""A hypothesis state machine drives the admin API of one real replica and checks every
answer against a plain model of nodes, jobs and tasks."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .inprocess import InProcessReplica

pytestmark = pytest.mark.timeout(180)


def make_machine(replica: InProcessReplica) -> type[RuleBasedStateMachine]:
    class ApiMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.prefix = uuid.uuid4().hex[:8]
            self.nodes: dict[str, dict[str, Any]] = {}
            self.jobs: dict[str, str] = {}
            self.tasks: dict[str, dict[str, Any]] = {}

        def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
            status, reply = replica.request(method, path, body)
            assert status < 500, (method, path, reply)
            return status, reply

        @rule(n=st.integers(0, 3), cpus=st.integers(1, 8))
        def register(self, n: int, cpus: int) -> None:
            node_id = f"{self.prefix}-n{n}"
            body = {
                "node_id": node_id,
                "address": "127.0.0.1:1",
                "resources": {"cpus": cpus, "memory": 1},
            }
            status, reply = self.call("POST", "/v1/nodes", body)
            assert status == 201
            model = self.nodes.setdefault(node_id, {"cordoned": False, "draining": False})
            assert reply["cordoned"] == model["cordoned"]
            assert reply["resources"]["cpus"] == cpus

        @rule(n=st.integers(0, 3), verb=st.sampled_from(["cordon", "uncordon", "drain"]))
        def flag(self, n: int, verb: str) -> None:
            node_id = f"{self.prefix}-n{n}"
            status, reply = self.call("POST", f"/v1/nodes/{node_id}/{verb}", {})
            if node_id not in self.nodes:
                assert status == 404
                return
            assert status == 200
            model = self.nodes[node_id]
            if verb == "uncordon":
                model.update(cordoned=False, draining=False)
            else:
                model["cordoned"] = True
                model["draining"] = model["draining"] or verb == "drain"
            assert (reply["cordoned"], reply["draining"]) == (model["cordoned"], model["draining"])

        @rule(j=st.integers(0, 2), ntasks=st.integers(0, 2))
        def submit(self, j: int, ntasks: int) -> None:
            job_id = f"{self.prefix}-j{j}"
            tasks = [
                {
                    "task_id": f"{job_id}-t{i}",
                    "kind": "rollout",
                    "actor": "shoal.learner.rollout:RolloutActor",
                }
                for i in range(ntasks)
            ]
            status, _ = self.call(
                "POST",
                "/v1/jobs",
                {"job_id": job_id, "spec": {"placement": "manual"}, "tasks": tasks},
            )
            if job_id in self.jobs:
                assert status == 409
                return
            assert status == 201
            self.jobs[job_id] = "running"
            for t in tasks:
                self.tasks[t["task_id"]] = {
                    "job": job_id,
                    "node": None,
                    "state": "pending",
                    "generation": 0,
                }

        @rule(j=st.integers(0, 2))
        def stop(self, j: int) -> None:
            job_id = f"{self.prefix}-j{j}"
            status, _ = self.call("POST", f"/v1/jobs/{job_id}/stop", {})
            if job_id not in self.jobs:
                assert status == 404
                return
            assert status == 200
            self.jobs[job_id] = "stopped"
            for t in self.tasks.values():
                if t["job"] == job_id and t["state"] in ("pending", "running"):
                    t["state"] = "stopped"

        @precondition(lambda self: self.tasks and self.nodes)
        @rule(data=st.data())
        def place(self, data: st.DataObject) -> None:
            task_id = data.draw(st.sampled_from(sorted(self.tasks)))
            node_id = data.draw(st.sampled_from(sorted(self.nodes)))
            status, _ = self.call(
                "POST", "/v1/placements", {"placements": [{"task_id": task_id, "node_id": node_id}]}
            )
            task = self.tasks[task_id]
            if self.nodes[node_id]["cordoned"] or self.jobs[task["job"]] == "stopped":
                assert status == 409
                return
            assert status == 200
            task.update(node=node_id, state="pending", generation=task["generation"] + 1)

        @precondition(lambda self: self.tasks)
        @rule(
            data=st.data(),
            state=st.sampled_from(["running", "stopped", "failed"]),
            stale=st.booleans(),
        )
        def report(self, data: st.DataObject, state: str, stale: bool) -> None:
            task_id = data.draw(st.sampled_from(sorted(self.tasks)))
            task = self.tasks[task_id]
            generation = task["generation"] + (1 if stale else 0)
            status, _ = self.call(
                "PUT", f"/v1/tasks/{task_id}/state", {"state": state, "generation": generation}
            )
            if stale:
                assert status == 409
                return
            assert status == 200
            task["state"] = state

        @invariant()
        def replica_agrees_with_model(self) -> None:
            _, nodes = self.call("GET", "/v1/nodes")
            mine = {n["id"]: n for n in nodes["nodes"] if n["id"].startswith(self.prefix)}
            assert set(mine) == set(self.nodes)
            for node_id, model in self.nodes.items():
                assert (mine[node_id]["cordoned"], mine[node_id]["draining"]) == (
                    model["cordoned"],
                    model["draining"],
                )
            _, jobs = self.call("GET", "/v1/jobs")
            assert {
                j["id"]: j["state"] for j in jobs["jobs"] if j["id"].startswith(self.prefix)
            } == self.jobs
            _, tasks = self.call("GET", "/v1/tasks")
            seen = {t["id"]: t for t in tasks["tasks"] if t["id"].startswith(self.prefix)}
            assert set(seen) == set(self.tasks)
            for task_id, model in self.tasks.items():
                got = seen[task_id]
                assert (got["node"], got["state"], got["generation"]) == (
                    model["node"],
                    model["state"],
                    model["generation"],
                )

    return ApiMachine


def test_api_matches_its_model(replica: InProcessReplica) -> None:
    run_state_machine_as_test(
        make_machine(replica),
        settings=settings(
            max_examples=8,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
