"""A child process serving a `worker` actor, for tests that need a real peer in another process:
`python -m tests.support.worker_child TOKEN` prints its transport address, then serves until its
stdin closes (see processes.worker_process)."""

from __future__ import annotations

import asyncio
import os
import sys

import torch  # before listening: under load a first tensor must not wait for the import

from shoal.runtime.actor import Actor
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach


class Worker(Actor):
    """Answers who it is, doubles tensors and naps (to hold an ask open)."""

    def pid(self) -> int:
        return os.getpid()

    def double(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * 2

    async def nap(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def main(token: str) -> None:
    async with ActorSystem() as system:
        await system.spawn(Worker, name="worker")
        transport = await attach(system, TransportConfig(token=token, relay=None))
        print(transport.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await transport.close()


if __name__ == "__main__":
    run(main(sys.argv[1]))
