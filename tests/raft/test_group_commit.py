"""Group commit in RaftBridge, on a real single-replica pysyncobj: writes that arrive while one
is in flight share one log entry, each keeps its own operation id and result, a retry inside a
group applies once, and a lone replica commits without waiting for its tick to time out."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.ports import free_port
from shoal.raft import commands as cmd
from shoal.raft.bridge import RaftBridge
from shoal.raft.config import CoordinatorConfig, RaftTimings
from shoal.raft.coordinator import _join_tick_thread, start_syncobj
from shoal.raft.state import ClusterState
from tests.support.waiting import eventually_async

from .inprocess import SECRET

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 5.0


def _config(data_dir: Path, timings: RaftTimings) -> CoordinatorConfig:
    return CoordinatorConfig(
        replica_id="c1",
        raft=f"127.0.0.1:{free_port()}",
        peers=(),
        api=f"127.0.0.1:{free_port()}",
        data_dir=data_dir,
        secret=SECRET,
        token="t",
        timings=timings,
    )


@contextlib.asynccontextmanager
async def lone_replica(
    data_dir: Path, timings: RaftTimings | None = None
) -> AsyncIterator[RaftBridge]:
    """A real pysyncobj replica without peers, led by itself, bridged to this loop."""
    state = ClusterState()
    bridge = RaftBridge(state, asyncio.get_running_loop())
    config = _config(data_dir, timings or RaftTimings())
    sync = start_syncobj(config, bridge, state)
    bridge.attach(sync)
    try:
        await eventually_async(
            lambda: bridge.is_leader() and sync.hasQuorum, "the lone replica leads"
        )
        yield bridge
    finally:
        sync.destroy()
        await asyncio.get_running_loop().run_in_executor(None, _join_tick_thread, sync)


def event(message: str, op_id: str | None = None) -> dict[str, Any]:
    return cmd.make_command(
        "add_event", {"kind": "test", "message": message}, op_id or f"op-{message}", time.time()
    )


def events(bridge: RaftBridge) -> list[str]:
    return bridge.state.read(lambda m: [e.message for e in m.events if e.kind == "test"])


def test_writes_arriving_together_share_one_log_entry_and_keep_their_results(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with lone_replica(tmp_path) as bridge:
            before = bridge.status()["commit_index"]
            results = await asyncio.gather(
                *(bridge.propose(event(str(i)), TIMEOUT) for i in range(100))
            )
            # The first goes alone; the 99 that queued behind it go as one group.
            assert (bridge.proposed, bridge.entries) == (100, 2)
            assert bridge.status()["commit_index"] - before == 2
            assert events(bridge) == [str(i) for i in range(100)]
            seqs = [r["seq"] for r in results]
            assert seqs == list(range(seqs[0], seqs[0] + 100))

    asyncio.run(main())


def test_a_retry_inside_a_group_applies_once_and_refusals_stay_with_their_member(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with lone_replica(tmp_path) as bridge:
            first = await bridge.propose(event("a"), TIMEOUT)
            unknown = cmd.make_command(
                "set_cordon", {"node_id": "nowhere", "cordoned": True}, "op-c", time.time()
            )
            lead, again, refused, fresh = await asyncio.gather(
                bridge.propose(event("lead"), TIMEOUT),
                bridge.propose(event("a"), TIMEOUT),  # the same op id as `first`
                bridge.propose(unknown, TIMEOUT),
                bridge.propose(event("b"), TIMEOUT),
            )
            assert again == first
            assert lead["ok"]
            assert fresh["ok"]
            assert not refused["ok"]
            assert refused["error"] == "not_found"
            assert events(bridge) == ["a", "lead", "b"]

    asyncio.run(main())


def test_a_client_batch_is_never_nested_in_a_group(tmp_path: Path) -> None:
    async def main() -> None:
        async with lone_replica(tmp_path) as bridge:
            batch = {
                "op": "batch",
                "op_id": "op-batch",
                "at": time.time(),
                "args": {"commands": [event("x"), event("y")]},
            }
            cmd.validate_command(batch)
            single, grouped = await asyncio.gather(
                bridge.propose(event("w"), TIMEOUT), bridge.propose(batch, TIMEOUT)
            )
            assert single["ok"]
            assert [r["ok"] for r in grouped["results"]] == [True, True]
            assert sorted(events(bridge)) == ["w", "x", "y"]

    asyncio.run(main())


def test_a_write_answered_is_counted_as_applied_at_once(tmp_path: Path) -> None:
    """pysyncobj answers a write before it counts the entry as applied; the index a read
    reports (X-Shoal-Commit-Index) must still include every write already answered."""

    async def main() -> None:
        async with lone_replica(tmp_path) as bridge:
            for i in range(50):
                before = bridge.last_applied()
                await bridge.propose(event(str(i)), TIMEOUT)
                assert bridge.last_applied() > before

    asyncio.run(main())


def test_a_lone_replica_commits_without_waiting_for_its_tick_to_time_out(
    tmp_path: Path,
) -> None:
    """pysyncobj's thread sleeps up to `tick_period` when no socket wakes it; a replica
    without peers has none. With a 2 s tick, writes that must commit within 1 s can only
    succeed if the bridge wakes the tick itself."""

    async def main() -> None:
        async with lone_replica(tmp_path, RaftTimings(tick_period=2.0)) as bridge:
            for i in range(10):
                assert (await bridge.propose(event(str(i)), 1.0))["ok"]
            assert events(bridge) == [str(i) for i in range(10)]

    asyncio.run(main())


@settings(
    deadline=None,
    max_examples=15,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(bursts=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_any_pattern_of_bursts_applies_every_write_once_in_proposal_order(
    tmp_path: Path, bursts: list[int]
) -> None:
    data_dir = Path(tempfile.mkdtemp(dir=tmp_path))

    async def main() -> None:
        async with lone_replica(data_dir) as bridge:
            sent: list[str] = []
            seqs: list[int] = []
            for b, size in enumerate(bursts):
                names = [f"{b}.{i}" for i in range(size)]
                sent += names
                results = await asyncio.gather(*(bridge.propose(event(n), TIMEOUT) for n in names))
                seqs += [r["seq"] for r in results]
            assert events(bridge) == sent
            assert seqs == list(range(seqs[0], seqs[0] + len(sent)))
            assert bridge.entries <= sum(min(size, 2) for size in bursts)

    asyncio.run(main())
