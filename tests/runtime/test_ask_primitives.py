"""The primitives the transport serves remote asks with: `_ask_nowait` and `_ask_queued`."""

from __future__ import annotations

import asyncio

import pytest

from shoal.runtime.actor import Actor
from shoal.runtime.errors import ActorNotFound, AskTimeout, MailboxFull, UnknownMethod
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem


class Gate(Actor):
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def wait(self) -> str:
        await self.gate.wait()
        return "opened"

    def double(self, n: int) -> int:
        return 2 * n

    def boom(self) -> None:
        raise ValueError("bad 7")


@pytest.mark.timeout(20)
def test_ask_nowait_queues_at_once_and_its_future_carries_the_reply() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, asyncio.Event(), name="gate", mailbox_size=4)
            reply = ref._ask_nowait("double", (21,), {}, 5.0)
            assert not isinstance(reply, asyncio.Task)  # a plain future, no task per ask
            assert await reply == 42
            with pytest.raises(UnknownMethod, match="double"):
                ref._ask_nowait("nope", (), {}, 5.0)
            failed = ref._ask_nowait("boom", (), {}, 5.0)
            with pytest.raises(ValueError, match="bad 7"):
                await failed

    run(main())


@pytest.mark.timeout(20)
def test_a_full_mailbox_refuses_ask_nowait_and_ask_queued_waits_within_its_timeout() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            gate = asyncio.Event()
            ref = await system.spawn(Gate, gate, name="gate", mailbox_size=1)
            first = ref._ask_nowait("wait", (), {}, 5.0)
            await asyncio.sleep(0.01)  # the actor is now inside `wait`, holding nothing queued
            second = ref._ask_nowait("double", (1,), {}, 5.0)  # fills the mailbox
            with pytest.raises(MailboxFull):
                ref._ask_nowait("double", (2,), {}, 5.0)
            with pytest.raises(AskTimeout, match="could not even be queued"):
                await ref._ask_queued("double", (3,), {}, 0.05)
            queued = asyncio.ensure_future(ref._ask_queued("double", (4,), {}, 5.0))
            await asyncio.sleep(0.01)
            assert not queued.done()
            gate.set()
            assert await first == "opened"
            assert await second == 2
            assert await (await queued) == 8

    run(main())


@pytest.mark.timeout(20)
def test_ask_nowait_times_out_and_refuses_a_stopped_actor() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, asyncio.Event(), name="gate")
            stuck = ref._ask_nowait("wait", (), {}, 0.05)
            with pytest.raises(AskTimeout, match="no reply within"):
                await stuck
            await system.stop_actor(ref)
            with pytest.raises(ActorNotFound, match="has stopped"):
                ref._ask_nowait("double", (1,), {}, 5.0)
            with pytest.raises(ActorNotFound, match="has stopped"):
                await ref._ask_queued("double", (1,), {}, 5.0)

    run(main())
