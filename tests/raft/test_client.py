"""The async client against one real replica: typed errors, idempotent retries, batching."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from shoal.raft.batcher import CommandBatcher
from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import (
    Conflict,
    Forbidden,
    NoQuorum,
    NotFound,
    Unavailable,
    ValidationError,
)

from .inprocess import TOKEN, InProcessReplica, free_port

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def run(
    replica: InProcessReplica, fn: Callable[[CoordinatorClient], Awaitable[Any]], token: str = TOKEN
) -> Any:
    async def main() -> Any:
        async with CoordinatorClient([replica.url], token, timeout=5.0) as client:
            return await fn(client)

    return asyncio.run(main())


def test_typed_errors_come_back_as_the_server_raised_them(replica: InProcessReplica) -> None:
    with pytest.raises(NotFound, match="no node"):
        run(replica, lambda c: c.node("nobody"))
    with pytest.raises(NotFound):
        run(replica, lambda c: c.cordon("nobody"))
    with pytest.raises(ValidationError) as exc:
        run(replica, lambda c: c.register_node("n-bad", "127.0.0.1:1", cpus=-1, memory=1))
    assert exc.value.field == "body.resources.cpus"
    with pytest.raises(Forbidden):
        run(replica, lambda c: c.nodes(), token="wrong")
    run(replica, lambda c: c.submit_job(job_id="client-job"))
    with pytest.raises(Conflict) as conflict:
        run(replica, lambda c: c.submit_job(job_id="client-job"))
    assert conflict.value.field == "job_id"


def test_a_write_retried_with_the_same_operation_id_has_one_effect(
    replica: InProcessReplica,
) -> None:
    async def twice(client: CoordinatorClient) -> tuple[Any, Any]:
        first = await client.submit_job(job_id="retried-job", op_id="op-retry-1")
        again = await client.submit_job(job_id="retried-job", op_id="op-retry-1")
        return first, again

    first, again = run(replica, twice)
    assert first == again
    jobs = run(replica, lambda c: c.jobs())
    assert [j["id"] for j in jobs].count("retried-job") == 1


def test_events_long_poll_wakes_on_a_new_event(replica: InProcessReplica) -> None:
    async def scenario(client: CoordinatorClient) -> dict[str, Any]:
        last = (await client.events())["last_seq"]
        waiter = asyncio.create_task(client.events(since=last, wait=10.0))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await client.add_event("note", "wake up")
        return await waiter

    got = run(replica, scenario)
    assert [e["message"] for e in got["events"]] == ["wake up"]


def test_a_long_poll_longer_than_the_request_timeout_returns_empty(
    replica: InProcessReplica,
) -> None:
    async def scenario() -> dict[str, Any]:
        async with CoordinatorClient(
            [replica.url], TOKEN, timeout=2.0, request_timeout=0.3
        ) as client:
            last = (await client.events())["last_seq"]
            return await client.events(since=last, wait=0.8)

    assert asyncio.run(scenario())["events"] == []


def test_concurrent_writes_are_coalesced_into_batches(replica: InProcessReplica) -> None:
    async def scenario(client: CoordinatorClient) -> list[dict[str, Any]]:
        batcher = CommandBatcher(client)
        submits = [
            batcher.submit("add_event", {"kind": "burst", "message": str(i)}) for i in range(500)
        ]
        return await asyncio.gather(*submits)

    results = run(replica, scenario)
    assert len(results) == 500
    assert all(r["ok"] for r in results)
    seqs = [r["seq"] for r in results]
    assert len(set(seqs)) == 500


def test_a_refused_member_of_a_batch_raises_only_for_its_caller(replica: InProcessReplica) -> None:
    async def scenario(client: CoordinatorClient) -> list[Any]:
        batcher = CommandBatcher(client)
        return await asyncio.gather(
            batcher.submit("add_event", {"kind": "k", "message": "fine"}),
            batcher.submit("stop_job", {"job_id": "no-such-job"}),
            return_exceptions=True,
        )

    fine, refused = run(replica, scenario)
    assert fine["ok"]
    assert isinstance(refused, NotFound)


def test_no_replica_answering_is_unavailable_within_the_timeout() -> None:
    async def main() -> None:
        async with CoordinatorClient(
            [f"http://127.0.0.1:{free_port()}"], TOKEN, timeout=0.5
        ) as client:
            await client.nodes()

    with pytest.raises(Unavailable):
        asyncio.run(main())


def test_the_client_finds_the_leader(replica: InProcessReplica) -> None:
    assert run(replica, lambda c: c.find_leader()) == replica.url


@contextlib.asynccontextmanager
async def stub_replica(method: str, path: str, handler: Handler) -> AsyncIterator[str]:
    """Whatever answers on a replica's port: one route of `handler`; yields its URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_a_reply_nested_too_deep_is_unavailable_not_a_recursion_error() -> None:
    """A replica (or whatever answers on its port) is not trusted to send sane JSON either."""

    async def deep(request: web.Request) -> web.Response:
        return web.Response(body=b"[" * 100_000, content_type="application/json")

    async def main() -> None:
        async with (
            stub_replica("GET", "/v1/nodes", deep) as url,
            CoordinatorClient([url], TOKEN, timeout=0.5) as c,
        ):
            await c.nodes()

    with pytest.raises(Unavailable, match="deeper than"):
        asyncio.run(main())


def test_a_replicas_answer_beats_a_dead_replicas_silence() -> None:
    """With a majority down the one replica left answers NoQuorum and the others refuse the
    connection: the caller is told NoQuorum (what to do: bring replicas back), whichever
    replica the client tried last (tests/raft/test_failover.py once got "connection
    refused" on a loaded machine)."""

    async def no_quorum(request: web.Request) -> web.Response:
        body = {"error": "no_quorum", "message": "this replica reaches no majority"}
        return web.json_response(body, status=503)

    async def main() -> None:
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        async with (
            stub_replica("POST", "/v1/events", no_quorum) as url,
            CoordinatorClient([url, *dead], TOKEN, timeout=0.5) as c,
        ):
            await c.add_event("acked", "never")

    with pytest.raises(NoQuorum):
        asyncio.run(main())
