"""A real single-replica coordinator (pysyncobj + aiohttp) served from a thread of the test
process: fast enough for API tests that need no failover."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

from shoal.ports import free_port
from shoal.raft.config import CoordinatorConfig
from shoal.raft.coordinator import Coordinator
from tests.support.waiting import DEFAULT_TIMEOUT_S, eventually

TOKEN = "test-token-0123456789"
SECRET = "test-cluster-secret-0123456789"


class InProcessReplica:
    """Start with `start()`, always `close()` (fixtures do it in finally)."""

    def __init__(self, data_dir: Path, **overrides: Any) -> None:
        defaults: dict[str, Any] = {
            "replica_id": "c1",
            "raft": f"127.0.0.1:{free_port()}",
            "peers": (),
            "api": f"127.0.0.1:{free_port()}",
            "data_dir": data_dir,
            "secret": SECRET,
            "token": TOKEN,
        }
        self.config = CoordinatorConfig(**{**defaults, **overrides})
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            await Coordinator(self.config).serve(self._stop)

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:
            self.error = exc
        finally:
            self._loop.close()

    def start(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._thread.start()
        eventually(self._leads, "the replica leads", timeout, lambda: f"error: {self.error!r}")

    def _leads(self) -> bool:
        try:
            status, body = self.request("GET", "/v1/cluster")
        except OSError:
            return False
        return status == 200 and body["leader_id"] == "c1"

    def close(self) -> None:
        if self._thread.is_alive():
            while self._stop is None:
                time.sleep(0.01)
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=20)

    @property
    def url(self) -> str:
        return self.config.api_url

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        token: str | None = TOKEN,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        host, port = self.config.api.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            hdrs = dict(headers or {})
            if token is not None:
                hdrs["Authorization"] = f"Bearer {token}"
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read()
            ctype = resp.getheader("Content-Type", "")
            self.last_headers = dict(resp.getheaders())
            return resp.status, json.loads(text) if "json" in ctype else text.decode()
        finally:
            conn.close()
