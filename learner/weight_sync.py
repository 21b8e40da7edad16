"""Learner → rollout weight sync: one policy version at a time, in versioned, checksummed buckets.

A whole state dict in one frame stops working past the transport's frame cap (256 MiB) and makes
every sync all-or-nothing. Here a version travels as `weights_begin(version, manifest)`, then
`weights_bucket(version, part, index, data, checksum)` for each bucket, then
`weights_commit(version, part)`. Buckets are flat byte buffers cut in order from the bytes a
part carries (a tensor bigger than a bucket spans several), each at most `bucket_mb` and always
under the frame cap, each with an XXH3-64 checksum. This module is the learner side; the plan, limits and
config both ends share are in weight_plan.py.

A version is published in `parts`: a sharded model's shard group splits it, each rank the rows
of every tensor that it holds as its own shard (`row_span`: FSDP2's dim-0 split), so no rank
gathers a tensor or keeps the whole version in host memory, and each sends its part to every
rollout actor of the group (the learner's `register` subscribes the actor with its peers). A
replicated or single rank is one part of one. The learner side, from trainer.py::

    broadcaster = WeightBroadcaster(cfg.weight_sync, source=group_incarnation)
    # after each update, on every rank of the shard group:
    snapshot = WeightSnapshot.plan_for(version, params, cfg.weight_sync, part=p, parts=n)
    snapshot.attach(loop)
    broadcaster.publish(snapshot)              # newest wins: older in-flight transfers stop
    await asyncio.to_thread(snapshot.fill, params, partial(owned_rows, part=p, parts=n))
    broadcaster.add(actor_id, ref)             # register / subscribe: the actor gets the current part
    broadcaster.remove(actor_id)               # an actor that is gone
    await broadcaster.close()

`source` is the shard group's incarnation (its first rank's): a rollout actor adopts only
weights from the one it registered with, so a restarted learner is never confused with its
predecessor even when its version went back to a checkpoint's.

The receiving side, `WeightAssembler` (weight_assembler.py), is pure: it checks the manifest
against the local model's own names and shapes before allocating anything, checks every
bucket's part, index, length and checksum, and hands out the weights only once every part is
committed; a newer version drops a half-received one. See docs/weight-sync.md for the limits
and failure behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from shoal.errors import ConfigError
from shoal.learner.errors import WeightSyncError
from shoal.learner.weight_plan import (
    MAX_BUCKETS,
    MAX_PARTS,
    MAX_SOURCE_CHARS,
    WIRE_NAMES,
    Chunk,
    WeightSyncConfig,
    bucket_count,
    checksum,
    part_sizes,
    plan_buckets,
    wire_dtype,
)
from shoal.runtime import wire
from shoal.runtime.errors import ActorError, WireError
from shoal.runtime.ref import ActorRef

log = logging.getLogger(__name__)

# -- the learner side --------------------------------------------------------------------------


class WeightSnapshot:
    """One policy version in host memory, cut into buckets, ready to send to any number of actors.

    Made in two steps so that sending overlaps building: `plan` lays the buckets out from the
    tensors' shapes (no data yet, so it can be published at once), `fill` gathers and copies
    the tensors in a worker thread and marks each bucket ready as its last byte lands, and a
    transfer awaits `bucket(i)`, so bucket 0 is on the wire while later ones are still being
    cut. `build` does both, for callers that want the whole snapshot first. Buckets are never
    written after they are ready: a transfer hands their memory to the socket."""

    def __init__(
        self,
        version: int,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        plan: list[list[Chunk]],
        limit: int,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        self.version = version
        self.specs = specs
        self.plan = plan
        self.part = part
        self.parts = parts
        self.owned = part_sizes(
            [(shape, dtype.itemsize) for _, dtype, shape in specs], part, parts
        )[1]
        """Bytes of each tensor this part carries (all of them when it is the only part)."""
        self.manifest: dict[str, Any] = {
            "tensors": [[name, WIRE_NAMES[dtype], list(shape)] for name, dtype, shape in specs],
            "bucket_bytes": limit,
            "buckets": len(plan),
            "nbytes": sum(self.owned),
            "part": part,
            "parts": parts,
        }
        self.buckets = [np.empty(sum(c.length for c in chunks), np.uint8) for chunks in plan]
        self.checksums = [0] * len(plan)
        self.build_s = 0.0
        self.ready = 0
        """Buckets 0 .. ready-1 are complete (written by the filling thread, read anywhere)."""
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def __repr__(self) -> str:
        return (
            f"<WeightSnapshot v{self.version} part {self.part}/{self.parts}: "
            f"{self.ready}/{len(self.plan)} buckets ready>"
        )

    @property
    def nbytes(self) -> int:
        return sum(int(bucket.nbytes) for bucket in self.buckets)

    @classmethod
    def plan_for(
        cls,
        version: int,
        params: Sequence[tuple[str, torch.Tensor]],
        cfg: WeightSyncConfig,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        part: int = 0,
        parts: int = 1,
    ) -> WeightSnapshot:
        """The buckets of `params` (names, wire dtypes, shapes), not filled yet: of all their
        bytes, or, as part `part` of `parts`, of the rows that part owns (`row_span`)."""
        if not 0 <= part < parts <= MAX_PARTS:
            raise WeightSyncError(f"part {part} of {parts} is not a part (at most {MAX_PARTS})")
        limit = cfg.bucket_bytes(max_frame_bytes)
        specs = [(name, wire_dtype(t.dtype, cfg), tuple(t.shape)) for name, t in params]
        _, sizes = part_sizes([(shape, dtype.itemsize) for _, dtype, shape in specs], part, parts)
        if bucket_count(sum(sizes), limit) > MAX_BUCKETS:
            raise WeightSyncError(
                f"{sum(sizes)} bytes in buckets of {limit} make more than {MAX_BUCKETS} buckets: "
                "raise weight_sync.bucket_mb"
            )
        return cls(version, specs, plan_buckets(sizes, limit), limit, part, parts)

    @classmethod
    def build(
        cls,
        version: int,
        params: Sequence[tuple[str, torch.Tensor]],
        take: Callable[[torch.Tensor], torch.Tensor],
        cfg: WeightSyncConfig,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        part: int = 0,
        parts: int = 1,
    ) -> WeightSnapshot:
        """`plan_for` and `fill` in one call: the whole snapshot (or part), ready."""
        snapshot = cls.plan_for(
            version, params, cfg, max_frame_bytes=max_frame_bytes, part=part, parts=parts
        )
        snapshot.fill(params, take)
        return snapshot

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let transfers on `loop` wait for buckets (before `fill` starts in its thread)."""
        self._loop = loop
        self._changed = asyncio.Event()

    def fill(
        self,
        params: Sequence[tuple[str, torch.Tensor]],
        take: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Take this part's rows of each tensor in order (`take(t)`: the whole tensor for the
        only part; one tensor at a time on its device, never the model; it may gather, a
        collective, so every rank fills in the same order), cast them to the wire dtype there,
        copy their bytes into the buckets, and mark each bucket ready once complete. Any
        thread; a failure is recorded for the waiting transfers, then raised."""
        started = time.perf_counter()
        last_tensor = [max(chunk.tensor for chunk in chunks) for chunks in self.plan]
        by_tensor: list[list[tuple[int, Chunk]]] = [[] for _ in self.specs]
        for b, chunks in enumerate(self.plan):
            for chunk in chunks:
                by_tensor[chunk.tensor].append((b, chunk))
        try:
            for t, ((name, tensor), (_, dtype, _), placed) in enumerate(
                zip(params, self.specs, by_tensor)
            ):
                rows = take(tensor).detach().reshape(-1)
                if rows.numel() * dtype.itemsize != self.owned[t]:
                    raise WeightSyncError(
                        f"part {self.part} of {self.parts} owns {self.owned[t]} bytes of {name}, "
                        f"given {rows.numel() * dtype.itemsize}"
                    )
                self._cut(rows, dtype, placed)
                del rows
                done = self.ready
                while done < len(self.plan) and last_tensor[done] <= t:
                    self.checksums[done] = checksum(self.buckets[done])
                    done += 1
                self._mark(done)
        except BaseException as exc:
            self.failure = f"building version {self.version} failed: {exc}"
            self._mark(self.ready)
            raise
        finally:
            self.build_s = time.perf_counter() - started

    def _cut(self, rows: torch.Tensor, dtype: torch.dtype, placed: list[tuple[int, Chunk]]) -> None:
        """Copy one tensor's `rows` (flat, in their own dtype, on their device) into its chunks
        of the buckets as `dtype`. A chunk on element boundaries takes the cast as it copies,
        into the bucket itself: no temporary the size of the tensor (allocating one, and its
        page faults, cost 5x the copy here, docs/weight-sync.md); a chunk that splits an
        element (after an odd-sized bool tensor, say) copies bytes of a cast temporary."""
        size = dtype.itemsize
        cast: torch.Tensor | None = None
        for b, chunk in placed:
            target = torch.from_numpy(self.buckets[b])[chunk.at : chunk.at + chunk.length]
            if chunk.at % size == chunk.start % size == chunk.length % size == 0:
                lo = chunk.start // size
                target.view(dtype).copy_(rows[lo : lo + chunk.length // size])
                continue
            if cast is None:
                cast = rows.to(dtype).contiguous().view(torch.uint8)
            target.copy_(cast[chunk.start : chunk.start + chunk.length])

    def _mark(self, ready: int) -> None:
        self.ready = ready
        if self._loop is not None and self._changed is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                self._loop.call_soon_threadsafe(self._changed.set)

    async def bucket(self, index: int) -> tuple[np.ndarray, int]:
        """Bucket `index` and its checksum once ready (on the loop `attach` named)."""
        while self.ready <= index:
            if self.failure is not None:
                raise WeightSyncError(self.failure)
            if self._changed is None:
                raise WeightSyncError(
                    f"bucket {index} of version {self.version} is not built and nothing fills "
                    "it: attach() the snapshot before filling it in another thread"
                )
            self._changed.clear()
            if self.ready > index or self.failure is not None:
                continue
            await self._changed.wait()
        return self.buckets[index], self.checksums[index]


class _Transfer(NamedTuple):
    version: int
    task: asyncio.Task[None]


class WeightBroadcaster:
    """Sends the newest snapshot to every registered actor, one transfer task per actor.

    Used on the event loop that owns the refs. Each transfer sends with `await ref.tell...`, so a
    slow actor's link back-pressures only its own transfer; each has `deadline_s`, after which it
    is abandoned with an ERROR and counted, and that actor gets the next version. A transfer
    whose link fails drops its actor (a rollout worker that died would otherwise be sent every
    version for the rest of the job); a live one registers again (rollout.py `StaleWatch`). A
    newer snapshot cancels every older transfer still in flight (the actor drops the half it
    holds)."""

    def __init__(self, cfg: WeightSyncConfig, source: str) -> None:
        if not isinstance(source, str) or not 0 < len(source) <= MAX_SOURCE_CHARS:
            raise ConfigError(
                f"source = {source!r} is invalid: the learner's incarnation, 1 to "
                f"{MAX_SOURCE_CHARS} characters (actors adopt only weights from the one they "
                "registered with)"
            )
        self.cfg = cfg
        self.source = source
        self.snapshot: WeightSnapshot | None = None
        self._actors: dict[str, ActorRef] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._closed = False
        self._stats = {
            "completed": 0,
            "superseded": 0,
            "timed_out": 0,
            "failed": 0,
            "bytes": 0,
            "seconds": 0.0,
        }

    def publish(self, snapshot: WeightSnapshot) -> None:
        """Make `snapshot` the current version and start sending it to every actor."""
        if self.snapshot is not None and snapshot.version < self.snapshot.version:
            raise WeightSyncError(
                f"version {snapshot.version} is older than the published {self.snapshot.version}"
            )
        self.snapshot = snapshot
        for actor_id in self._actors:
            self._start(actor_id)

    def add(self, actor_id: str, ref: ActorRef) -> None:
        """Register (or re-register) an actor; it gets the current snapshot, if any, at once."""
        self._actors[actor_id] = ref
        self._start(actor_id)

    def serves(self, actor_id: str) -> bool:
        """Whether `actor_id` gets each new version (registered, and not dropped since)."""
        return actor_id in self._actors

    def remove(self, actor_id: str) -> None:
        self._actors.pop(actor_id, None)
        transfer = self._transfers.pop(actor_id, None)
        if transfer is not None:
            transfer.task.cancel()

    async def close(self) -> None:
        """Stop every transfer and wait for them to end."""
        self._closed = True
        tasks = [t.task for t in self._transfers.values()]
        self._transfers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> dict[str, float]:
        """Transfers completed, superseded by a newer version, timed out and failed (link
        gone); bytes sent and seconds spent in completed transfers; those in flight; and the
        current snapshot's version, part of how many, and host bytes."""
        in_flight = sum(not t.task.done() for t in self._transfers.values())
        snapshot = self.snapshot
        held = {"version": -1, "part": 0, "parts": 1, "snapshot_bytes": 0}
        if snapshot is not None:
            held = {
                "version": snapshot.version,
                "part": snapshot.part,
                "parts": snapshot.parts,
                "snapshot_bytes": snapshot.nbytes,
            }
        return {**self._stats, "in_flight": in_flight, **held}

    def _start(self, actor_id: str) -> None:
        snapshot = self.snapshot
        if snapshot is None or self._closed:
            return
        previous = self._transfers.get(actor_id)
        if previous is not None and not previous.task.done():
            previous.task.cancel()
            self._stats["superseded"] += 1
        task = asyncio.create_task(
            self._transfer(actor_id, self._actors[actor_id], snapshot, previous),
            name=f"weights v{snapshot.version} to {actor_id}",
        )
        self._transfers[actor_id] = _Transfer(snapshot.version, task)

    async def _transfer(
        self,
        actor_id: str,
        ref: ActorRef,
        snapshot: WeightSnapshot,
        previous: _Transfer | None,
    ) -> None:
        if previous is not None:  # its frames go out before ours: the actor sees versions in order
            await asyncio.gather(previous.task, return_exceptions=True)
        sent = 0
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.deadline_s):
                manifest = {**snapshot.manifest, "source": self.source}
                await ref.tell.weights_begin(snapshot.version, manifest)
                for index in range(len(snapshot.buckets)):
                    data, crc = await snapshot.bucket(index)
                    await ref.tell.weights_bucket(snapshot.version, snapshot.part, index, data, crc)
                    sent += 1
                    self._stats["bytes"] += int(data.nbytes)
                await ref.tell.weights_commit(snapshot.version, snapshot.part)
        except TimeoutError:
            self._stats["timed_out"] += 1
            log.error(
                "weights version %d to actor %s (%s) timed out after %.1f s with %d of %d buckets "
                "sent; it gets the next version",
                snapshot.version, actor_id, ref.path, self.cfg.deadline_s, sent,
                len(snapshot.buckets),
            )  # fmt: skip
            return
        except WeightSyncError as exc:  # the snapshot's fill failed: no actor's doing
            self._stats["failed"] += 1
            log.warning(
                "weights version %d to actor %s failed: %s", snapshot.version, actor_id, exc
            )
            return
        except (ActorError, WireError) as exc:
            self._stats["failed"] += 1
            if self._actors.get(actor_id) is ref:  # gone: not sent to again unless it registers
                del self._actors[actor_id]
            log.warning(
                "weights version %d to actor %s failed after %d buckets (%s); dropped it until "
                "it registers again",
                snapshot.version, actor_id, sent, exc,
            )  # fmt: skip
            return
        self._stats["completed"] += 1
        self._stats["seconds"] += time.perf_counter() - started
