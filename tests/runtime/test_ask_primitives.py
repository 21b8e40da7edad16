"""The primitives the transport serves remote asks with: `_ask_nowait` and `_ask_queued`,
which queue an ask whose outcome goes to a reply slot the caller owns."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.runtime.actor import Actor
from shoal.runtime.errors import ActorNotFound, AskTimeout, MailboxFull, UnknownMethod
from shoal.runtime.loop import run
from shoal.runtime.ref import ActorRef
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


class Slot:
    """A reply slot like the transport's: settled once, in the consumer's own turn."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, Any]] = []
        self.settled = asyncio.Event()

    def done(self) -> bool:
        return bool(self.outcomes)

    def set_result(self, result: Any, /) -> None:
        self.outcomes.append(("result", result))
        self.settled.set()

    def set_exception(self, exception: BaseException, /) -> None:
        self.outcomes.append(("error", exception))
        self.settled.set()

    async def outcome(self) -> tuple[str, Any]:
        await asyncio.wait_for(self.settled.wait(), 5)
        assert len(self.outcomes) == 1
        return self.outcomes[0]


def ask_nowait(ref: ActorRef, method: str, *args: Any) -> Slot:
    slot = Slot()
    ref._ask_nowait(method, args, {}, 5.0, slot)
    return slot


@pytest.mark.timeout(20)
def test_ask_nowait_queues_at_once_and_the_consumer_settles_the_slot() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, asyncio.Event(), name="gate", mailbox_size=4)
            assert await ask_nowait(ref, "double", 21).outcome() == ("result", 42)
            with pytest.raises(UnknownMethod, match="double"):
                ask_nowait(ref, "nope")
            kind, error = await ask_nowait(ref, "boom").outcome()
            assert kind == "error"
            assert isinstance(error, ValueError)

    run(main())


@pytest.mark.timeout(20)
def test_a_full_mailbox_refuses_ask_nowait_and_ask_queued_waits_within_its_timeout() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            gate = asyncio.Event()
            ref = await system.spawn(Gate, gate, name="gate", mailbox_size=1)
            first = ask_nowait(ref, "wait")
            await asyncio.sleep(0.01)  # the actor is now inside `wait`, holding nothing queued
            second = ask_nowait(ref, "double", 1)  # fills the mailbox
            with pytest.raises(MailboxFull):
                ask_nowait(ref, "double", 2)
            with pytest.raises(AskTimeout, match="could not even be queued"):
                await ref._ask_queued("double", (3,), {}, 0.05, Slot())
            third = Slot()
            queued = asyncio.ensure_future(ref._ask_queued("double", (4,), {}, 5.0, third))
            await asyncio.sleep(0.01)
            assert not queued.done()
            gate.set()
            assert await first.outcome() == ("result", "opened")
            assert await second.outcome() == ("result", 2)
            await queued
            assert await third.outcome() == ("result", 8)

    run(main())


@pytest.mark.timeout(20)
def test_a_stopped_actor_refuses_both_primitives_and_fails_what_it_left_queued() -> None:
    async def main() -> None:
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, asyncio.Event(), name="gate")
            stuck = ask_nowait(ref, "wait")
            left = ask_nowait(ref, "double", 1)
            await system.stop_actor(ref)
            assert (await stuck.outcome())[0] == "error"
            kind, error = await left.outcome()
            assert kind == "error"
            assert isinstance(error, ActorNotFound)
            with pytest.raises(ActorNotFound, match="has stopped"):
                ask_nowait(ref, "double", 1)
            with pytest.raises(ActorNotFound, match="has stopped"):
                await ref._ask_queued("double", (1,), {}, 5.0, Slot())

    run(main())
