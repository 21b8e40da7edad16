"""shoal's side of `shoal bench learner`'s weight-sync rows: a WeightSnapshot of the learner's
parameters sent by a WeightBroadcaster over the actor runtime's transport to a receiver in a
second process that does what a rollout actor does with it (assemble the buckets, check every
checksum, load the complete version into its own copy of the model).

The time runs from the learner's fp32 parameters (the snapshot is cut into buckets — cast to
the wire dtype, copied, checksummed — while the ready buckets are already sent, as the learner
does) to the receiver answering that it adopted the version: an ask on the same
link after the commit, which the receiver's mailbox handles after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from shoal.bench.learner_child import build_policy
from shoal.errors import ShoalError
from shoal.learner.weight_assembler import WeightAssembler
from shoal.learner.weight_plan import WeightSyncConfig
from shoal.learner.weight_sync import WeightBroadcaster, WeightSnapshot
from shoal.runtime.actor import Actor
from shoal.runtime.loop import run as run_loop
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach

TOKEN = "bench-learner-token"
SEQ = 64
SLOW_ASK_S = 600.0
"""Building a 1B-parameter model, or adopting one, on a loaded 2-core machine takes minutes."""


class Receiver(Actor):
    """The rollout side of a sync: one policy, one assembler, the last version adopted (what
    RolloutActor does with weights, in worker threads as it does, without collecting)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.assembler: WeightAssembler | None = None
        self.version = -1

    async def prepare(self, shape: dict[str, int]) -> int:
        """Build the model the next versions are for (outside any timing; off the event loop,
        which must keep answering the link's heartbeats)."""
        self.model = await asyncio.to_thread(build_policy, shape, SEQ)
        self.assembler = WeightAssembler(self.model.state_dict())
        self.version = -1
        return sum(p.numel() for p in self.model.parameters())

    def weights_begin(self, version: int, manifest: dict[str, Any]) -> None:
        self._assembler().begin(version, manifest)

    async def weights_bucket(
        self, version: int, part: int, index: int, data: Any, crc: int
    ) -> None:
        await asyncio.to_thread(self._assembler().bucket, version, part, index, data, crc)

    async def weights_commit(self, version: int, part: int) -> None:
        complete = await asyncio.to_thread(self._assembler().commit, version, part)
        if complete is not None:
            await asyncio.to_thread(self.model.set_weights, complete[1])
            self.version = version

    def adopted(self) -> int:
        return self.version

    def _assembler(self) -> WeightAssembler:
        if self.assembler is None:
            raise ShoalError("the receiver got weights before `prepare`")
        return self.assembler


async def _serve() -> None:
    async with ActorSystem() as system:
        await system.spawn(Receiver, name="receiver")
        transport = await attach(system, TransportConfig(token=TOKEN, tls=None))
        print(json.dumps({"address": transport.address}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await transport.close()


def serve() -> None:
    """Entry point of the receiving process; runs until its stdin closes."""
    run_loop(_serve())


@contextlib.contextmanager
def receiving_process() -> Iterator[str]:
    """The receiver's process; yields its transport address."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from shoal.bench.learner_sync import serve; serve()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise ShoalError(
                "the weight-sync receiver exited before listening; run "
                "`python -c 'from shoal.bench.learner_sync import serve; serve()'` to see why"
            )
        yield json.loads(line)["address"]
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@contextlib.asynccontextmanager
async def _client() -> AsyncIterator[ActorSystem]:
    async with ActorSystem() as system:
        transport = await attach(system, TransportConfig(token=TOKEN, tls=None))
        try:
            yield system
        finally:
            await transport.close()


async def _measure(
    cases: list[dict[str, Any]], bucket_mb: float, repeats: int
) -> list[dict[str, Any]]:
    results = []
    with receiving_process() as address:
        async with _client() as system:
            receiver = system.ref(f"{address}/receiver")
            for case in cases:
                await receiver.ask(timeout=SLOW_ASK_S).prepare(case["shape"])
                cfg = WeightSyncConfig(bucket_mb=bucket_mb, wire_dtype=case["dtype"])
                model = await asyncio.to_thread(build_policy, case["shape"], SEQ)
                runs = [await _one_sync(receiver, model, v, cfg) for v in range(repeats)]
                results.append(min(runs, key=lambda run: run["seconds"]))
    return results


async def _one_sync(receiver: Any, model: Any, version: int, cfg: WeightSyncConfig) -> Any:
    broadcaster = WeightBroadcaster(cfg, source="bench")
    broadcaster.add("receiver", receiver)
    try:
        start = time.perf_counter()
        params = list(model.state_dict().items())
        snapshot = WeightSnapshot.plan_for(version, params, cfg)  # as LearnerCore.stream does
        snapshot.attach(asyncio.get_running_loop())
        broadcaster.publish(snapshot)
        await asyncio.to_thread(snapshot.fill, params, _whole)
        while broadcaster.stats()["completed"] < 1:
            if broadcaster.stats()["in_flight"] == 0:
                raise ShoalError(
                    f"weights version {version} did not reach the receiver: {broadcaster.stats()}"
                )
            await asyncio.sleep(0.001)
        adopted = await receiver.ask(timeout=SLOW_ASK_S).adopted()
        elapsed = time.perf_counter() - start
    finally:
        await broadcaster.close()
    if adopted != version:
        raise ShoalError(f"the receiver adopted version {adopted}, not {version}")
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": snapshot.nbytes,
        "buckets": len(snapshot.buckets),
        "build_s": snapshot.build_s,
        "seconds": elapsed,
    }


def _whole(tensor: Any) -> Any:
    return tensor


def measure(
    cases: list[dict[str, Any]], bucket_mb: float, repeats: int = 1
) -> list[dict[str, Any]]:
    """The best of `repeats` syncs per case ({"shape", "dtype"}; versions 0, 1, … of a fresh
    receiver model), in order, through one receiving process."""
    return run_loop(_measure(cases, bucket_mb, repeats))
