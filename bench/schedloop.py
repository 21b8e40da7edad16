"""`shoal bench schedloop`: what the leader's scheduler loop costs per round on a large state.

- reading the state into scheduler inputs (held under the state's lock) beside
  `StateMachine.snapshot()`, the plain copy of every record any full reader pays;
- a placement round for every task of a new job (conversion, `place`, the commands and events)
  beside `place(...)` alone on the same requests: the loop's overhead over the pure scheduler.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from shoal.bench.report import Row
from shoal.raft.commands import make_command
from shoal.raft.machine import StateMachine
from shoal.raft.scheduling_decide import Memory, decide
from shoal.raft.scheduling_inputs import read_inputs
from shoal.scheduler.model import RolloutActor
from shoal.scheduler.placement import place
from shoal.scheduler.signals import BalancerConfig

GIB = 1 << 30


def _state(nodes: int, tasks: int, placed: bool) -> StateMachine:
    ids = itertools.count()
    m = StateMachine()

    def run(op: str, args: dict[str, Any]) -> None:
        m.apply(make_command(op, args, f"b{next(ids)}", 1000.0))

    for i in range(nodes):
        gpus = [
            {"index": g, "uuid": f"n{i}-{g}", "island": f"n{i}/nvl0", "domain": "d0"}
            for g in range(8)
        ]
        resources = {"cpus": 64, "memory": 512 * GIB, "gpus": gpus}
        run("register_node", {"node_id": f"n{i}", "address": f"h{i}:1", "resources": resources})
    specs = [
        {"task_id": f"t{i}", "kind": "rollout", "actor": "a.b:C", "resources": {"cpus": 1}}
        for i in range(tasks)
    ]
    for start in range(0, tasks, 4096):
        job = {
            "job_id": f"j{start}",
            "spec": {"placement": "auto"},
            "tasks": specs[start : start + 4096],
        }
        run("submit_job", job)
    if placed:
        placements = [{"task_id": f"t{i}", "node_id": f"n{i % nodes}"} for i in range(tasks)]
        run("place_tasks", {"placements": placements})
    return m


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def run(quick: bool) -> list[Row]:
    nodes, tasks, repeats = (64, 1000, 3) if quick else (512, 8000, 7)
    busy = _state(nodes, tasks, placed=True)
    read = _best(lambda: read_inputs(busy), repeats)
    copy = _best(busy.snapshot, repeats)
    fresh = _state(nodes, tasks, placed=False)
    inputs = read_inputs(fresh)
    actors = [RolloutActor(t, 1.0) for t in inputs.pending]
    round_ms = _best(
        lambda: decide(read_inputs(fresh), Memory(), 1000.0, BalancerConfig()), repeats
    )
    bare = _best(lambda: place(inputs.topology, inputs.placements, (), actors), repeats)
    size = f"{nodes} nodes, {tasks} tasks"
    return [
        Row(
            f"state -> scheduler inputs ({size})",
            "ms",
            read,
            copy,
            "StateMachine.snapshot()",
            False,
        ),
        Row(f"placement round, all pending ({size})", "ms", round_ms, bare, "place() alone", False),
    ]
