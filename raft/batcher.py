"""Client-side write coalescing: concurrent `submit` calls become one `/v1/batch` request and
one Raft log entry, which is how the client reaches tens of thousands of writes per second.

Each member keeps its own operation id and the batch has one too, so a batch retried across a
leader change is applied once. For the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

from shoal.raft.client import CoordinatorClient
from shoal.raft.errors import Conflict, NotFound

MAX_BATCH = 2000


class CommandBatcher:
    """`await batcher.submit(op, args)` returns that command's result or raises its refusal."""

    def __init__(
        self, client: CoordinatorClient, max_batch: int = MAX_BATCH, max_in_flight: int = 4
    ) -> None:
        self._client = client
        self._max_batch = max_batch
        self._pending: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = []
        self._slots = asyncio.Semaphore(max_in_flight)
        self._flushing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Operation ids: one random prefix per batcher and a counter (uuid4 per write is costly).
        self._prefix = uuid.uuid4().hex
        self._count = itertools.count()

    async def submit(
        self, op: str, args: dict[str, Any], op_id: str | None = None
    ) -> dict[str, Any]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        op_id = op_id or f"{self._prefix}-{next(self._count)}"
        self._pending.append(({"op": op, "args": args, "op_id": op_id}, future))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        result = await future
        if not result["ok"]:
            error = NotFound if result["error"] == "not_found" else Conflict
            raise error(result["message"], result.get("field"))
        return result

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every caller of this loop iteration enqueue first
        while self._pending:
            await self._slots.acquire()
            chunk, self._pending = (
                self._pending[: self._max_batch],
                self._pending[self._max_batch :],
            )
            task = asyncio.get_running_loop().create_task(self._send(chunk))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(0)
        self._flushing = None

    async def _send(
        self, chunk: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]]
    ) -> None:
        try:
            results = await self._client.batch([command for command, _ in chunk])
        except Exception as exc:  # every waiter must wake, whatever went wrong
            for _, future in chunk:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), result in zip(chunk, results):
                if not future.done():
                    future.set_result(result)
        finally:
            self._slots.release()
