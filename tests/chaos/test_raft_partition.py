"""A replica partitioned on its Raft links, in a real 3-replica cluster whose replicas reach
each other only through fault proxies: a partitioned leader loses leadership, the majority
elects another and takes writes, and after healing the replica catches up to an equal digest.

What happens to leadership after healing is not asserted: pysyncobj has no pre-vote, so the
healed replica may call an election at a higher term and unseat the majority's leader (see
docs/chaos.md, "Raft partitions")."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos import invariants
from shoal.chaos.errors import ChaosError, FaultError
from shoal.chaos.raft_mesh import RaftMesh, both_ends
from shoal.chaos.runner import run_scenario
from shoal.chaos.scenario import parse
from shoal.chaos.traffic import NetFaults
from shoal.chaos.workload import make_client
from shoal.local import LocalCluster, coordinator_specs
from shoal.raft.client import CoordinatorClient
from tests.support.waiting import eventually

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
LEADS = re.compile(r"(?P<replica>\S+) leads term (?P<term>\d+)")


def _views(cluster: LocalCluster, digest: bool = False) -> dict[str, dict[str, Any] | None]:
    return {s.name: cluster.cluster_view(s.name, digest) for s in cluster.specs()}


def _cut_off(cluster: LocalCluster, name: str) -> bool:
    """`name` sees none of its peers connected and no peer sees `name` connected (each replica's
    own pysyncobj view, in /v1/cluster), while the others still see each other."""
    raft = {s.name: s.raft for s in cluster.specs()}
    views = _views(cluster)
    if any(v is None for v in views.values()):
        return False
    for other, view in views.items():
        assert view is not None
        for peer in view["replicas"]:
            isolated_link = name in (other, _name_of(raft, peer["raft"]))
            if peer["connected"] == isolated_link:
                return False
    return True


def _name_of(raft: dict[str, str | None], address: str) -> str:
    return next(name for name, adv in raft.items() if adv == address)


def _all_connected(cluster: LocalCluster) -> bool:
    views = _views(cluster)
    return all(v is not None and all(p["connected"] for p in v["replicas"]) for v in views.values())


async def _until(what: str, check: Callable[[], Any], within: float = 60.0) -> Any:
    """`eventually` in a worker thread: the fault proxies run on this test's event loop."""
    return await asyncio.to_thread(eventually, check, what, within)


def _one_leader_and_converged(cluster: LocalCluster) -> str | None:
    """The leader's name once exactly one replica is leader, every replica names it, and all
    show the same state digest at the same commit index; else None."""
    views = _views(cluster, digest=True)
    if any(v is None for v in views.values()):
        return None
    leaders = [name for name, v in views.items() if v and v["state"] == "leader"]
    named = {v["leader_id"] for v in views.values() if v}
    indexes = {v["commit_index"] for v in views.values() if v}
    if len(leaders) != 1 or named != set(leaders) or len(indexes) != 1:
        return None
    return leaders[0] if invariants.digests_equal(views).held else None


def _event_messages(cluster: LocalCluster, name: str) -> set[str]:
    """The messages in `name`'s own copy of the event log (a local read, not forwarded)."""
    api = cluster.spec(name).api_url
    return {
        e["message"] for e in cluster.get(f"{api}/v1/events?limit=1000", timeout=10.0)["events"]
    }


def test_a_partitioned_leader_steps_down_and_catches_up_after_healing(tmp_path: Path) -> None:
    """What the design guarantees, and only that: the cut-off replica leads no longer and
    commits nothing the majority wrote while it was away; after healing there is one leader
    per term (in every replica's committed log), every replica reaches the same state and
    commit index, and every acknowledged write survives on each of them.

    Which replica leads is not asserted, neither after the heal nor at the cut: pysyncobj
    has no pre-vote, so the healed replica, back with a higher term, may call an election
    and unseat the majority's leader; and on a loaded machine leadership may move between
    `wait_ready` and the cut, so the replica cut off may already be a follower that still
    names the majority's leader (an isolated pysyncobj follower starts no election)."""
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3, raft_bind=True))

    async def main() -> None:
        mesh = RaftMesh(cluster)
        try:
            await mesh.start(cluster.specs())
            await asyncio.to_thread(cluster.start_all)
            leader_api = await asyncio.to_thread(cluster.wait_ready, None, 60.0)
            old = next(s.name for s in cluster.specs() if s.api_url == leader_api)
            others = [s for s in cluster.specs() if s.name != old]

            detail = mesh.isolate(old)
            assert f"Raft links of {old}" in detail

            def new_leader() -> str | None:
                views = _views(cluster)
                leaders = {v["leader_id"] for n, v in views.items() if v and n != old}
                mine = views[old]
                stepped_down = mine is not None and mine["state"] != "leader"
                if (
                    len(leaders) == 1
                    and None not in leaders
                    and old not in leaders
                    and stepped_down
                ):
                    return str(leaders.pop())
                return None

            await _until("the majority elects a new leader", new_leader)
            await _until(f"{old} is cut off both ways", lambda: _cut_off(cluster, old))
            urls = [s.api_url for s in others if s.api_url]
            acknowledged = {f"written by the majority {i}" for i in range(5)}
            # Patient: on a loaded machine the majority may hold elections of its own meanwhile.
            async with CoordinatorClient(urls, cluster.token, timeout=60.0) as client:
                for message in sorted(acknowledged):
                    await client.add_event("partition", message)
            cut_off_view = await _until(f"{old} answers", lambda: cluster.cluster_view(old))
            assert cut_off_view["state"] != "leader"
            unheard = acknowledged & _event_messages(cluster, old)
            assert not unheard, f"{old} applied {sorted(unheard)} while cut off"

            assert "healed" in mesh.heal(old)
            # Any one leader: without pre-vote the healed replica may force another election.
            await _until(
                "one leader, and every replica at the same state and commit index",
                lambda: _one_leader_and_converged(cluster),
            )
            for spec in cluster.specs():
                messages = _event_messages(cluster, spec.name)
                missing = acknowledged - messages
                assert not missing, f"{spec.name} lacks acknowledged writes {sorted(missing)}"
                assert _leaders_by_term(messages), f"{spec.name} recorded no leader"
                for term, leaders in _leaders_by_term(messages).items():
                    assert len(leaders) == 1, f"term {term} had leaders {sorted(leaders)}"
        finally:
            await mesh.close()

    try:
        asyncio.run(main())
    finally:
        cluster.stop_all()


def _leaders_by_term(messages: set[str]) -> dict[int, set[str]]:
    """term -> the replicas that announced themselves its leader, from the committed
    `<replica> leads term <term>` events (raft/machine.py `_announce_leader`)."""
    out: dict[int, set[str]] = {}
    for message in messages:
        found = LEADS.fullmatch(message)
        if found:
            out.setdefault(int(found["term"]), set()).add(found["replica"])
    return out


def test_each_replica_whatever_its_address_is_cut_off_both_ways(tmp_path: Path) -> None:
    """pysyncobj dials from the higher address to the lower, so the lowest, middle and highest
    replica each have their links on different proxies; each must end up fully isolated."""
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3, raft_bind=True))

    async def main() -> None:
        mesh = RaftMesh(cluster)
        try:
            await mesh.start(cluster.specs())
            await asyncio.to_thread(cluster.start_all)
            await asyncio.to_thread(cluster.wait_ready, None, 60.0)
            for name in [s.name for s in sorted(cluster.specs(), key=lambda s: str(s.raft))]:
                mesh.isolate(name)
                await _until(f"{name} is cut off", functools.partial(_cut_off, cluster, name))
                mesh.heal(name)
                await _until("every link is back", lambda: _all_connected(cluster))
        finally:
            await mesh.close()

    try:
        asyncio.run(main())
    finally:
        cluster.stop_all()


def test_a_raft_partition_needs_replicas_that_bind_behind_a_proxy(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3))
    scenario = parse("[[faults]]\nkind = 'raft-partition'\ntarget = 'leader'\nat = 1")
    with pytest.raises(ChaosError, match=r"coordinator_specs\(\.\.\., raft_bind=True\)"):
        run_scenario(scenario, cluster)
    assert all(cluster.pid(s.name) is None for s in cluster.specs())
    with pytest.raises(ChaosError, match="c1 binds its advertised Raft address itself"):
        asyncio.run(RaftMesh(cluster).start(cluster.specs()))


def test_partitioning_a_replica_that_is_not_running_is_refused(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3, raft_bind=True))

    async def main() -> None:
        mesh = RaftMesh(cluster)
        try:
            await mesh.start(cluster.specs())
            with pytest.raises(FaultError, match="c2 is not running"):
                mesh.isolate("c2")
        finally:
            await mesh.close()

    asyncio.run(main())


def _dropped(mesh: RaftMesh) -> int:
    return sum(p.stats.dropped for p in mesh.proxies.values())


def test_raft_links_delayed_and_lossy_still_commit_and_converge(tmp_path: Path) -> None:
    """The leader's links delayed with jitter, then a follower's made lossy (connections cut):
    writes still commit, a leader stays or is re-elected, and after healing every replica's
    digest is equal. Each degraded replica has both its links degraded, whatever its address."""
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3, raft_bind=True))

    async def write(n: int, what: str) -> None:
        async with make_client(cluster.api_urls(), cluster.token) as client:
            for i in range(n):
                await client.add_event("raft-links", f"{what} {i}")

    async def main() -> None:
        mesh = RaftMesh(cluster)
        try:
            await mesh.start(cluster.specs())
            await asyncio.to_thread(cluster.start_all)
            leader_api = await asyncio.to_thread(cluster.wait_ready, None, 60.0)
            await _until("every link is up", lambda: _all_connected(cluster))
            leader = next(s.name for s in cluster.specs() if s.api_url == leader_api)
            follower = next(s.name for s in cluster.specs() if s.name != leader)

            detail = mesh.delay(leader, 0.05, 0.02)
            assert "delay 0.05 ± 0.02 s" in detail
            assert (
                "(1 into it, 1 opened" in detail
                or "(2 into it, 0 opened" in detail
                or ("(0 into it, 2 opened" in detail)
            )
            await write(5, "delayed")

            detail = mesh.loss(follower, 0.3, mode="drop")
            assert "loss 0.3 (drop)" in detail
            await write(5, "lossy")
            await _until("a lossy link was cut", lambda: _dropped(mesh) > 0)
            await asyncio.to_thread(cluster.wait_ready, None, 60.0)  # a leader, agreed on

            mesh.heal(leader)
            mesh.heal(follower)
            await _until("every link is back", lambda: _all_connected(cluster))
            await write(3, "healed")

            def converged() -> bool:
                return invariants.digests_equal(_views(cluster, digest=True)).held

            await _until("digests are equal", converged)
        finally:
            await mesh.close()

    try:
        asyncio.run(main())
    finally:
        cluster.stop_all()


def test_degrading_raft_links_refuses_bad_input(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 3, raft_bind=True))

    async def main() -> None:
        mesh = RaftMesh(cluster)
        try:
            await mesh.start(cluster.specs())
            with pytest.raises(FaultError, match="c2 is not running"):
                mesh.delay("c2", 0.1)
            await asyncio.to_thread(cluster.start, "c1")
            with pytest.raises(FaultError, match=r"Raft links of c1: loss=2\.0 must be"):
                mesh.loss("c1", 2.0)
            with pytest.raises(FaultError, match="Raft links of c1: loss_mode='cut' is not one"):
                mesh.loss("c1", 0.1, mode="cut")
            mesh.isolate("c1")
            with pytest.raises(FaultError, match="c1 is partitioned; heal it"):
                mesh.delay("c1", 0.1)
            assert "healed" in mesh.heal("c1")
            assert "delay 0.1 ± 0 s" in mesh.delay("c1", 0.1)
        finally:
            await mesh.close()

    try:
        asyncio.run(main())
    finally:
        cluster.stop_all()


link_faults = st.builds(
    NetFaults,
    delay_s=st.floats(0, 10),
    jitter_s=st.floats(0, 10),
    loss=st.floats(0, 1),
    loss_mode=st.sampled_from(["drop", "stall"]),
    stall_s=st.floats(0, 10),
)


@given(link_faults, link_faults)
def test_a_link_degraded_at_both_ends_is_at_least_as_bad_as_either(a, b):
    ab, ba = both_ends(a, b), both_ends(b, a)
    assert ab.delay_s == pytest.approx(a.delay_s + b.delay_s)
    assert ab.jitter_s == pytest.approx(a.jitter_s + b.jitter_s)
    assert max(a.loss, b.loss) - 1e-12 <= ab.loss <= 1.0
    assert ab.loss == pytest.approx(ba.loss)
    assert ab.loss_mode == (a if a.loss >= b.loss else b).loss_mode


@given(link_faults)
def test_an_undegraded_far_end_changes_nothing(a):
    alone = both_ends(a, NetFaults())
    assert alone.delay_s == a.delay_s
    assert alone.jitter_s == a.jitter_s
    assert alone.loss == pytest.approx(a.loss)
    assert (alone.loss_mode, alone.stall_s) == (a.loss_mode, a.stall_s)
