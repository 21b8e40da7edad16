"""The node's fault executor against a real in-process coordinator with chaos enabled: each
fault runs once, its outcome is kept on disk and reported; a node-kill whose report was
lost is not run again by the restarted node, which re-sends the outcome instead; gpu-xid goes
through the simulated backend only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.node_faults import MAX_OUTCOMES, FaultOrder, FaultOutcomes, NodeFaults, to_execute
from shoal.ports import free_port
from shoal.raft.client import CoordinatorClient
from shoal.raft.config import ChaosSection
from shoal.scheduler.health.clock import OffsetClock
from shoal.scheduler.health.simgpu import SimGpuBackend
from tests.raft.inprocess import TOKEN, InProcessReplica

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessReplica]:
    rep = InProcessReplica(tmp_path_factory.mktemp("coord"), chaos=ChaosSection(enabled=True))
    try:
        rep.start()
        node = {
            "node_id": "n1",
            "address": "127.0.0.1:9",
            "resources": {
                "cpus": 2,
                "memory": 2**30,
                "gpus": [{"index": i, "uuid": f"GPU-{i}"} for i in range(2)],
            },
        }
        assert rep.request("POST", "/v1/nodes", node)[0] == 201
        yield rep
    finally:
        rep.close()


def request_fault(replica: InProcessReplica, **body: Any) -> dict[str, Any]:
    status, fault = replica.request("POST", "/v1/chaos/faults", body)
    assert status == 202, fault
    return dict(fault)


def fault_state(replica: InProcessReplica, fault_id: str) -> dict[str, Any]:
    return dict(replica.request("GET", f"/v1/chaos/faults/{fault_id}")[1])


async def run_offer(
    url: str,
    data_dir: Path,
    records: list[dict[str, Any]],
    sim: Path | None = None,
    clock: Path | None = None,
) -> list[str]:
    """Offer `records` to a fresh executor (a node process starting anew) until it is done: the
    deaths it asked for, then each non-zero clock offset seen meanwhile."""
    deaths: list[str] = []
    async with CoordinatorClient([url], TOKEN, timeout=1.0, request_timeout=0.5) as client:
        faults = NodeFaults("n1", client, data_dir, sim, clock, die=lambda: deaths.append("died"))
        faults.offer(records, {})
        skewed = []
        while faults._jobs:
            offset = 0.0 if clock is None else OffsetClock(clock, refresh=0).offset()
            if offset:
                skewed.append(offset)
            await asyncio.wait(faults._jobs, timeout=0.05)
        await faults.close()
    return deaths + [f"offset {s:g}" for s in dict.fromkeys(skewed)]


def test_a_node_kill_whose_report_was_lost_is_not_run_again(
    replica: InProcessReplica, tmp_path: Path
) -> None:
    fault = request_fault(replica, kind="node-kill", target="n1")
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert asyncio.run(run_offer(unreachable, tmp_path, [fault])) == ["died"]
    assert fault_state(replica, fault["id"])["state"] == "requested"
    assert fault["id"] in FaultOutcomes(tmp_path / "chaos-faults.json")

    # The node is back; the coordinator still lists the fault as requested.
    assert asyncio.run(run_offer(replica.url, tmp_path, [fault])) == []
    back = fault_state(replica, fault["id"])
    assert back["state"] == "injected"
    assert "SIGKILLed itself" in back["message"]


def test_gpu_xid_goes_through_the_simulated_backend(
    replica: InProcessReplica, tmp_path: Path
) -> None:
    state = tmp_path / "simgpu.json"
    SimGpuBackend(2, state_file=state)
    fault = request_fault(replica, kind="gpu-xid", target="n1", gpu=1, xid=94)
    assert asyncio.run(run_offer(replica.url, tmp_path, [fault], state)) == []
    done = fault_state(replica, fault["id"])
    assert (done["state"], done["message"]) == (
        "injected",
        "XID 94 raised on simulated GPU 1 of node n1",
    )
    assert json.loads(state.read_text())["xids"] == [{"seq": 1, "gpu": 1, "xid": 94}]


def test_gpu_xid_is_refused_on_real_gpus(replica: InProcessReplica, tmp_path: Path) -> None:
    fault = request_fault(replica, kind="gpu-xid", target="n1", gpu=0)
    asyncio.run(run_offer(replica.url, tmp_path, [fault], None))
    done = fault_state(replica, fault["id"])
    assert done["state"] == "failed"
    assert "never on real NVML GPUs" in done["message"]
    assert "--sim-gpus" in done["message"]


def test_a_task_fault_for_a_task_not_running_here_fails_with_the_reason(
    replica: InProcessReplica, tmp_path: Path
) -> None:
    job = {
        "job_id": "jf",
        "spec": {"placement": "manual"},
        "tasks": [{"task_id": "tf", "kind": "rollout-worker", "actor": "a.b:main"}],
    }
    assert replica.request("POST", "/v1/jobs", job)[0] == 201
    placement = {"placements": [{"task_id": "tf", "node_id": "n1"}]}
    assert replica.request("POST", "/v1/placements", placement)[0] == 200
    fault = request_fault(replica, kind="task-kill", target="tf")
    asyncio.run(run_offer(replica.url, tmp_path, [fault]))
    done = fault_state(replica, fault["id"])
    assert done["state"] == "failed"
    assert "does not run on node n1" in done["message"]


def test_clock_skew_moves_the_hooked_clock_for_its_duration(
    replica: InProcessReplica, tmp_path: Path
) -> None:
    clock = tmp_path / "clock-offset"
    fault = request_fault(replica, kind="clock-skew", target="n1", offset_s=2.5, duration_s=0.6)
    assert asyncio.run(run_offer(replica.url, tmp_path, [fault], clock=clock)) == ["offset 2.5"]
    done = fault_state(replica, fault["id"])
    assert (done["state"], done["message"]) == ("healed", "clock true again after 0.6 s")
    assert OffsetClock(clock, refresh=0).offset() == 0.0


def test_clock_skew_fails_on_a_node_without_the_clock_hook(
    replica: InProcessReplica, tmp_path: Path
) -> None:
    fault = request_fault(replica, kind="clock-skew", target="n1", offset_s=1.0, duration_s=1.0)
    asyncio.run(run_offer(replica.url, tmp_path, [fault]))
    done = fault_state(replica, fault["id"])
    assert done["state"] == "failed"
    assert "SHOAL_CHAOS_CLOCK_FILE" in done["message"]


def test_the_outcomes_survive_a_restart_and_keeps_the_newest(tmp_path: Path) -> None:
    path = tmp_path / "chaos-faults.json"
    outcomes = FaultOutcomes(path)
    for i in range(MAX_OUTCOMES + 3):
        outcomes.record(f"f{i}", "injected", f"m{i}")
    again = FaultOutcomes(path)
    assert len(again.entries) == MAX_OUTCOMES
    assert "f2" not in again
    assert again.entries[f"f{MAX_OUTCOMES + 2}"] == ("injected", f"m{MAX_OUTCOMES + 2}")


def test_unreadable_outcomes_start_empty(tmp_path: Path) -> None:
    path = tmp_path / "chaos-faults.json"
    path.write_text("{half")
    assert FaultOutcomes(path).entries == {}


ids = st.sampled_from([f"f{i}" for i in range(8)])


@given(st.lists(ids, unique=True), st.sets(ids), st.sets(ids))
def test_nothing_executes_twice(listed: list[str], done: set[str], busy: set[str]) -> None:
    outcomes = FaultOutcomes(Path("/nonexistent/outcomes.json"))
    outcomes.entries = {f: ("injected", "") for f in done}
    orders = [FaultOrder(f, "node-kill", "n1", 0.0, 0, None, None) for f in listed]
    chosen = to_execute(orders, outcomes, busy)
    assert chosen == [f for f in listed if f not in done and f not in busy]
