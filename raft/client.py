"""The async client of the coordinator's admin API: knows every replica, finds the leader,
and retries a write with the SAME operation id across a leader change, so it has one effect.

Errors come back as the same types the server raised (`NotFound`, `Conflict`, `ValidationError`,
`Unauthorized`, ...). Retryable trouble (no leader, no quorum, a replica down) is retried on
other replicas until the call's timeout; then the last such error is raised. For the event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aiohttp

from shoal.boundedjson import JsonRefused, JsonTooLarge, loads
from shoal.raft.errors import (
    ERRORS_BY_CODE,
    Busy,
    NoQuorum,
    NotLeader,
    RaftError,
    RaftTimeout,
    Unavailable,
    ValidationError,
)
from shoal.runtime.tls import TlsFiles, tls_from_env

RETRYABLE = (NotLeader, NoQuorum, Busy, RaftTimeout, Unavailable)
BACKOFF = 0.05
OP_HEADER = "X-Shoal-Op-Id"
MAX_REPLY_BYTES = 256 << 20
"""Far above any listing a coordinator sends; a replica that sends more is not believed."""
MAX_REPLY_DEPTH = 64


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    """A reply's JSON, read up to MAX_REPLY_BYTES and depth-checked before it is parsed:
    what comes off the network is not trusted, even from a replica. Raises `JsonRefused`."""
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise JsonTooLarge(f"a reply of more than {MAX_REPLY_BYTES} bytes")
        chunks.append(chunk)
    return loads(b"".join(chunks), max_bytes=MAX_REPLY_BYTES, max_depth=MAX_REPLY_DEPTH)


def _error_from(status: int, body: Any) -> RaftError:
    if not isinstance(body, dict) or body.get("error") not in ERRORS_BY_CODE:
        return Unavailable(f"HTTP {status} without a shoal error body: {str(body)[:200]}")
    cls = ERRORS_BY_CODE[body["error"]]
    if issubclass(cls, ValidationError):
        field, _, message = str(body["message"]).partition(": ")
        return cls(body.get("field") or field, message)
    if cls is NotLeader:
        return NotLeader(body["message"], body.get("leader"))
    exc = cls(body["message"])
    exc.field = body.get("field")
    return exc


class CoordinatorClient:
    """Use as `async with CoordinatorClient(urls, token) as client:`."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        timeout: float = 10.0,
        request_timeout: float = 3.0,
        tls: TlsFiles | None = None,
    ) -> None:
        """`tls`: the CA to check https replicas against (default: `$SHOAL_TLS_DIR`'s)."""
        if not urls:
            raise ValueError("CoordinatorClient needs at least one replica URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"}
        self._request_timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._preferred = self.urls[0]
        self._tls = tls

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # https:// replicas are checked against the cluster CA given, or the one
            # $SHOAL_TLS_DIR names (a certificate from shoal's own CA), else the system's CAs.
            tls = self._tls or tls_from_env()
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._request_timeout,
                connector=aiohttp.TCPConnector(
                    limit=256, ssl=tls.client_context() if tls else True
                ),
            )
        return self._session

    def _order(self) -> list[str]:
        rest = [u for u in self.urls if u != self._preferred]
        return [self._preferred, *rest] if self._preferred in self.urls else list(self.urls)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        op_id: str | None = None,
        timeout: float | None = None,
        hold: float = 0.0,
    ) -> Any:
        """One call with retries across replicas; writes pass an `op_id` (made here if None).
        `hold` is how long the server may legitimately hold the request (a long-poll)."""
        if method != "GET" and op_id is None:
            op_id = uuid.uuid4().hex
        headers = {OP_HEADER: op_id} if op_id else {}
        query = {k: _query_value(v) for k, v in (params or {}).items() if v is not None}
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        last: RaftError = Unavailable(f"no replica answered: {self.urls}")
        while True:
            for url in self._order():
                try:
                    return await self._once(method, url, path, body, query, headers, hold)
                except RETRYABLE as exc:
                    if not isinstance(exc, Unavailable) or isinstance(last, Unavailable):
                        last = exc  # a replica's answer (NoQuorum, ...) beats a dead one's silence
                    self._follow_hint(exc)
                if time.monotonic() >= deadline:
                    raise last
            await asyncio.sleep(min(BACKOFF, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise last

    def _follow_hint(self, exc: RaftError) -> None:
        if isinstance(exc, NotLeader) and exc.leader and exc.leader.rstrip("/") in self.urls:
            self._preferred = exc.leader.rstrip("/")

    async def _once(
        self,
        method: str,
        base: str,
        path: str,
        body: Any,
        query: dict[str, str],
        headers: dict[str, str],
        hold: float = 0.0,
    ) -> Any:
        url = base + path
        timeout = aiohttp.ClientTimeout(total=(self._request_timeout.total or 0.0) + hold)
        try:
            async with self.session.request(
                method, url, json=body, params=query, headers=headers, timeout=timeout
            ) as resp:
                data = (
                    await read_json(resp)
                    if resp.content_type == "application/json"
                    else await resp.text()
                )
                if resp.status >= 400:
                    raise _error_from(resp.status, data)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unavailable(f"{url}: {exc!r}") from None
        except JsonRefused as exc:
            raise Unavailable(f"{url}: the reply is not JSON this client reads: {exc}") from None
        self._preferred = base
        return data

    async def find_leader(self) -> str:
        """The leader's API URL, asked of any replica that knows it; preferred from then on."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for url in self.urls:
                try:
                    cluster = await self._once("GET", url, "/v1/cluster", None, {}, {})
                except RETRYABLE:
                    continue
                if cluster.get("leader_api") in self.urls:
                    self._preferred = cluster["leader_api"]
                    return str(cluster["leader_api"])
            await asyncio.sleep(BACKOFF)
        raise NoQuorum(f"no replica of {self.urls} knows a leader")

    # -- cluster ------------------------------------------------------------------------------

    async def cluster(self, consistent: bool = False, digest: bool = False) -> dict[str, Any]:
        params = {"consistent": consistent or None, "digest": digest or None}
        return dict(await self.request("GET", "/v1/cluster", params=params))

    async def batch(
        self, commands: list[dict[str, Any]], op_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Many commands in one log entry; each result is `{"ok": ...}`, refusals included."""
        reply = await self.request("POST", "/v1/batch", {"commands": commands}, op_id=op_id)
        return list(reply["results"])

    # -- nodes --------------------------------------------------------------------------------

    async def register_node(
        self,
        node_id: str,
        address: str,
        cpus: float,
        memory: int,
        gpus: list[dict[str, Any]] | None = None,
        labels: dict[str, str] | None = None,
        op_id: str | None = None,
    ) -> dict[str, Any]:
        body = {
            "node_id": node_id,
            "address": address,
            "resources": {"cpus": cpus, "memory": memory, "gpus": gpus or []},
            "labels": labels or {},
        }
        return dict(await self.request("POST", "/v1/nodes", body, op_id=op_id))

    async def heartbeat(self, node_id: str, health: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {} if health is None else {"health": health}
        return dict(await self.request("POST", f"/v1/nodes/{node_id}/heartbeat", body))

    async def nodes(
        self, liveness: str | None = None, consistent: bool = False
    ) -> list[dict[str, Any]]:
        reply = await self.request(
            "GET", "/v1/nodes", params={"liveness": liveness, "consistent": consistent or None}
        )
        return list(reply["nodes"])

    async def node(self, node_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/v1/nodes/{node_id}"))

    async def cordon(self, node_id: str) -> dict[str, Any]:
        return dict(await self.request("POST", f"/v1/nodes/{node_id}/cordon", {}))

    async def uncordon(self, node_id: str) -> dict[str, Any]:
        return dict(await self.request("POST", f"/v1/nodes/{node_id}/uncordon", {}))

    async def drain(self, node_id: str) -> dict[str, Any]:
        return dict(await self.request("POST", f"/v1/nodes/{node_id}/drain", {}))

    # -- jobs and tasks -----------------------------------------------------------------------

    async def submit_job(
        self,
        spec: dict[str, Any] | None = None,
        tasks: list[dict[str, Any]] | None = None,
        job_id: str | None = None,
        op_id: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"spec": spec or {}, "tasks": tasks or []}
        if job_id is not None:
            body["job_id"] = job_id
        return dict(await self.request("POST", "/v1/jobs", body, op_id=op_id))

    async def jobs(self) -> list[dict[str, Any]]:
        return list((await self.request("GET", "/v1/jobs"))["jobs"])

    async def job(self, job_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/v1/jobs/{job_id}"))

    async def stop_job(self, job_id: str) -> dict[str, Any]:
        return dict(await self.request("POST", f"/v1/jobs/{job_id}/stop", {}))

    async def add_tasks(self, job_id: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(await self.request("POST", f"/v1/jobs/{job_id}/tasks", {"tasks": tasks}))

    async def tasks(
        self, node: str | None = None, job: str | None = None, state: str | None = None
    ) -> list[dict[str, Any]]:
        reply = await self.request(
            "GET", "/v1/tasks", params={"node": node, "job": job, "state": state}
        )
        return list(reply["tasks"])

    async def set_task_state(
        self, task_id: str, state: str, generation: int | None = None, message: str = ""
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"state": state, "message": message}
        if generation is not None:
            body["generation"] = generation
        return dict(await self.request("PUT", f"/v1/tasks/{task_id}/state", body))

    async def publish_task_state(
        self, task_id: str, generation: int, state: dict[str, Any], op_id: str | None = None
    ) -> dict[str, Any]:
        """Replace what `generation` of the task published (a flat object of at most 4 KiB:
        `commands.PUBLISHED_STATE`); `Conflict` when that generation is no longer the task's."""
        body = {"generation": generation, "state": state}
        return dict(await self.request("PUT", f"/v1/tasks/{task_id}/published", body, op_id=op_id))

    async def place_tasks(
        self,
        placements: dict[str, str | None],
        gpus: dict[str, list[int]] | None = None,
    ) -> dict[str, Any]:
        """Place (or, with None, unplace) tasks by hand; `gpus` names a task's GPU indices
        on its node (else it gets the lowest free ones it asks for)."""
        rows = []
        for task_id, node_id in placements.items():
            row: dict[str, Any] = {"task_id": task_id, "node_id": node_id}
            if gpus and task_id in gpus:
                row["gpus"] = list(gpus[task_id])
            rows.append(row)
        return dict(await self.request("POST", "/v1/placements", {"placements": rows}))

    # -- checkpoints and events ---------------------------------------------------------------

    async def record_checkpoint(
        self, job_id: str, path: str, step: int, sha256: str, complete: bool
    ) -> dict[str, Any]:
        body = {
            "job_id": job_id,
            "path": path,
            "step": step,
            "sha256": sha256,
            "complete": complete,
        }
        return dict(await self.request("POST", "/v1/checkpoints", body))

    async def checkpoints(self, job: str | None = None) -> list[dict[str, Any]]:
        return list(
            (await self.request("GET", "/v1/checkpoints", params={"job": job}))["checkpoints"]
        )

    async def events(
        self, since: int = 0, wait: float = 0.0, limit: int | None = None
    ) -> dict[str, Any]:
        params = {"since": since, "wait": wait or None, "limit": limit}
        return dict(
            await self.request(
                "GET", "/v1/events", params=params, timeout=self.timeout + wait, hold=wait
            )
        )

    async def add_event(
        self,
        kind: str,
        message: str,
        fields: dict[str, Any] | None = None,
        op_id: str | None = None,
    ) -> dict[str, Any]:
        body = {"kind": kind, "message": message, "fields": fields or {}}
        return dict(await self.request("POST", "/v1/events", body, op_id=op_id))

    # -- chaos (only on a cluster whose config enables it) ------------------------------------

    async def inject_fault(
        self, kind: str, target: str, op_id: str | None = None, **params: Any
    ) -> dict[str, Any]:
        """Ask for a fault (`duration_s`, `gpu`, `xid` as the kind takes them); its node runs it."""
        body = {"kind": kind, "target": target, **params}
        return dict(await self.request("POST", "/v1/chaos/faults", body, op_id=op_id))

    async def fault(self, fault_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/v1/chaos/faults/{fault_id}"))

    async def faults(
        self, node: str | None = None, state: str | None = None
    ) -> list[dict[str, Any]]:
        reply = await self.request("GET", "/v1/chaos/faults", params={"node": node, "state": state})
        return list(reply["faults"])

    async def report_fault(self, fault_id: str, state: str, message: str = "") -> dict[str, Any]:
        body = {"state": state, "message": message}
        return dict(await self.request("PUT", f"/v1/chaos/faults/{fault_id}/outcome", body))


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
