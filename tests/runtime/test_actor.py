"""Actors: handlers, tell/ask semantics, back-pressure, timeouts, lifecycle hooks, children."""

import asyncio
import gc

import pytest

from shoal.runtime import Actor, ActorSystem, run
from shoal.runtime.actor import handler_names
from shoal.runtime.errors import (
    ActorError,
    ActorInterrupted,
    ActorNotFound,
    AskTimeout,
    InvalidTimeout,
    MailboxFull,
    NotAnActor,
    UnknownMethod,
)
from tests.support.waiting import eventually_async

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_asyncio_errors")]


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int = 1) -> int:
        self.n += k
        return self.n

    async def get(self) -> int:
        return self.n

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def _private(self) -> None:
        raise AssertionError("never callable")


class Gate(Actor):
    """Blocks in `wait` until `open` is set, to fill mailboxes on purpose."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate
        self.seen: list[int] = []

    async def wait(self) -> None:
        await self.gate.wait()

    def note(self, i: int) -> None:
        self.seen.append(i)

    def seen_so_far(self) -> list[int]:
        return list(self.seen)


def test_handlers_are_public_methods_the_subclass_defines():
    names, async_names = handler_names(Counter)
    assert names == {"add", "get", "fail"}
    assert async_names == {"get"}


def test_tell_and_ask_call_methods_in_order():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, 10, name="counter")
            await ref.tell.add(2)
            ref.tell_nowait.add(k=3)
            assert await ref.ask.add() == 16
            assert await ref.ask(timeout=5).get() == 16

    run(body())


def test_unknown_private_and_hook_methods_raise_unknown_method():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter)
            for method in ("nope", "_private", "on_start", "on_stop", "spawn", "context"):
                with pytest.raises(UnknownMethod, match="add, fail, get"):
                    await ref.ask(timeout=5).__getattr__(method)()
                with pytest.raises(UnknownMethod):
                    ref.tell_nowait.__getattr__(method)()
                with pytest.raises(UnknownMethod):
                    await ref.tell.__getattr__(method)()
            assert await ref.ask.get() == 0

    run(body())


def test_asker_gets_the_same_exception_and_actor_restarts_with_fresh_state():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, 5)
            await ref.ask.add(1)
            error = ValueError("bad input")
            with pytest.raises(ValueError) as caught:
                await ref.ask.fail("bad input")
            assert str(caught.value) == "bad input"
            assert await ref.ask.get() == 5  # a fresh instance from the same factory
            assert [f.action for f in system.failures] == ["restart"]
            assert isinstance(system.failures[0].error, ValueError)
            del error

    run(body())


def test_same_exception_object_reaches_the_asker():
    marker = KeyError("marker")

    class Raiser(Actor):
        def go(self) -> None:
            raise marker

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Raiser)
            with pytest.raises(KeyError) as caught:
                await ref.ask.go()
            assert caught.value is marker

    run(body())


def test_mailbox_survives_a_restart():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter)
            ref.tell_nowait.fail("x")
            for _ in range(5):
                ref.tell_nowait.add()
            assert await ref.ask.get() == 5

    run(body())


def test_tell_waits_for_room_and_tell_nowait_raises():
    async def body():
        gate = asyncio.Event()
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, gate, mailbox_size=2)
            ref.tell_nowait.wait()
            await asyncio.sleep(0.01)  # the actor is now blocked inside `wait`
            ref.tell_nowait.note(1)
            ref.tell_nowait.note(2)
            with pytest.raises(MailboxFull, match="mailbox_size"):
                ref.tell_nowait.note(99)
            blocked = asyncio.ensure_future(ref.tell.note(3))
            await asyncio.sleep(0.01)
            assert not blocked.done()
            gate.set()
            await asyncio.wait_for(blocked, 5)
            assert await ref.ask.seen_so_far() == [1, 2, 3]

    run(body())


def test_ask_timeout_and_the_actor_still_handles_it_later():
    async def body():
        gate = asyncio.Event()
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, gate)
            with pytest.raises(AskTimeout, match=r"no reply within 0\.05s"):
                await ref.ask(timeout=0.05).wait()
            with pytest.raises(TimeoutError):
                await ref.ask(timeout=0.05).note(1)
            gate.set()
            assert await ref.ask.seen_so_far() == [1]

    run(body())


def test_ask_timeout_counts_waiting_for_mailbox_room():
    async def body():
        gate = asyncio.Event()
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, gate, mailbox_size=1)
            ref.tell_nowait.wait()
            await asyncio.sleep(0.01)
            ref.tell_nowait.note(1)
            with pytest.raises(AskTimeout, match="mailbox stayed full"):
                await ref.ask(timeout=0.05).note(2)
            gate.set()
            assert await ref.ask.seen_so_far() == [1]

    run(body())


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "1", True])
def test_bad_ask_timeout(timeout):
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter)
            with pytest.raises(InvalidTimeout, match="positive"):
                ref.ask(timeout=timeout)

    run(body())


def test_ask_to_a_stopped_actor_raises_at_once_and_tell_is_a_dead_letter():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Counter, name="gone")
            await system.stop_actor(ref)
            with pytest.raises(ActorNotFound, match="stopped"):
                await ref.ask(timeout=30).get()
            await ref.tell.add()
            ref.tell_nowait.add()
            assert system.dead_letters.total == 3
            assert {d.reason for d in system.dead_letters} == {"actor stopped"}
            assert [d.recipient for d in system.dead_letters] == ["gone"] * 3
            with pytest.raises(ActorNotFound):
                system.lookup("gone")

    run(body())


def test_lifecycle_hook_order_through_start_restart_and_stop():
    events: list[str] = []

    class Hooks(Actor):
        instances = 0

        def __init__(self) -> None:
            Hooks.instances += 1
            self.me = Hooks.instances
            events.append(f"init{self.me}")

        async def on_start(self) -> None:
            events.append(f"start{self.me}")

        async def on_stop(self) -> None:
            events.append(f"stop{self.me}")

        async def on_restart(self, error: Exception) -> None:
            events.append(f"restart{self.me}:{error}")
            await super().on_restart(error)

        def fail(self) -> None:
            raise RuntimeError("oops")

        def ping(self) -> str:
            return "pong"

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Hooks)
            with pytest.raises(RuntimeError):
                await ref.ask.fail()
            assert await ref.ask.ping() == "pong"
        assert events == ["init1", "start1", "stop1", "init2", "restart2:oops", "start2", "stop2"]

    run(body())


def test_on_start_failure_makes_spawn_raise_and_frees_the_name():
    class Broken(Actor):
        async def on_start(self) -> None:
            raise OSError("no device")

    async def body():
        async with ActorSystem() as system:
            with pytest.raises(OSError, match="no device"):
                await system.spawn(Broken, name="b")
            with pytest.raises(ActorNotFound):
                system.lookup("b")
            await system.spawn(Counter, name="b")

    run(body())


def test_factory_that_builds_no_actor():
    async def body():
        async with ActorSystem() as system:
            with pytest.raises(NotAnActor, match="not an Actor"):
                await system.spawn(lambda: object())

    run(body())


def test_context_is_not_available_in_init():
    class Early(Actor):
        def __init__(self) -> None:
            self.context  # noqa: B018

    async def body():
        async with ActorSystem() as system:
            with pytest.raises(ActorError, match="from on_start on"):
                await system.spawn(Early)

    run(body())


def test_children_spawned_in_on_start_are_supervised_and_stopped_first():
    events: list[str] = []

    class Child(Actor):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        async def on_stop(self) -> None:
            events.append(f"stop {self.tag}")

        def tag_of(self) -> str:
            return self.tag

    class Parent(Actor):
        async def on_start(self) -> None:
            self.a = await self.spawn(Child, "a", name="child-a")
            self.b = await self.context.spawn(Child, "b", name="child-b")

        async def on_stop(self) -> None:
            events.append("stop parent")

        def kids(self) -> list[str]:
            return [ref.path for ref in self.context.children]

    async def body():
        async with ActorSystem() as system:
            parent = await system.spawn(Parent, name="parent")
            assert await parent.ask.kids() == ["child-a", "child-b"]
            child = system.lookup("child-a")
            assert await child.ask.tag_of() == "a"
            assert system.names == ["child-a", "child-b", "parent"]
        assert events == ["stop b", "stop a", "stop parent"]

    run(body())


def test_actor_can_stop_itself_from_a_handler():
    class Quitter(Actor):
        async def quit(self) -> str:
            await self.context.stop()
            return "bye"

        def ping(self) -> str:
            return "pong"

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Quitter, name="q")
            assert await ref.ask.quit() == "bye"

            await eventually_async(lambda: system.names == [], "the actor's name released")
            with pytest.raises(ActorNotFound):
                await ref.ask.ping()

    run(body())


def test_stop_interrupts_a_busy_handler_and_fails_its_ask():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Gate, asyncio.Event())
            pending = asyncio.ensure_future(ref.ask(timeout=30).wait())
            queued = asyncio.ensure_future(ref.ask(timeout=30).note(1))
            await asyncio.sleep(0.01)
            await system.stop_actor(ref)
            with pytest.raises(ActorInterrupted, match="partly run"):
                await pending
            with pytest.raises(ActorNotFound, match="before handling note"):
                await queued
            reasons = sorted(d.reason for d in system.dead_letters)
            assert reasons == ["interrupted by stop or restart", "left in mailbox at stop"]

    run(body())


def test_sync_and_async_hooks_both_work():
    events: list[str] = []

    class SyncHooks(Actor):
        def on_start(self) -> None:  # type: ignore[override]
            events.append("start")

        def on_stop(self) -> None:  # type: ignore[override]
            events.append("stop")

        def ping(self) -> int:
            return 1

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(SyncHooks)
            assert await ref.ask.ping() == 1
        assert events == ["start", "stop"]

    run(body())


def test_failed_on_start_stops_the_children_it_already_spawned():
    events: list[str] = []

    class Child(Actor):
        async def on_stop(self) -> None:
            events.append("child stopped")

    class HalfBuilt(Actor):
        async def on_start(self) -> None:
            await self.spawn(Child, name="orphan")
            raise OSError("second resource missing")

        async def on_stop(self) -> None:
            events.append("never: on_start did not finish")

    async def body():
        async with ActorSystem() as system:
            with pytest.raises(OSError, match="second resource"):
                await system.spawn(HalfBuilt, name="half")
            assert events == ["child stopped"]
            assert system.names == []
            assert asyncio.all_tasks() == {asyncio.current_task(), system._guardian._task}

    run(body())


def test_spawn_from_a_handler_that_is_stopped_midway_cleans_up():
    started = asyncio.Event()

    class Slow(Actor):
        async def on_start(self) -> None:
            started.set()
            await asyncio.sleep(3600)

    class Spawner(Actor):
        async def make(self) -> None:
            await self.spawn(Slow, name="slow")

    async def body():
        async with ActorSystem() as system:
            spawner = await system.spawn(Spawner, name="spawner")
            call = asyncio.ensure_future(spawner.ask(timeout=30).make())
            await started.wait()
            await system.stop_actor(spawner)
            with pytest.raises(ActorInterrupted):
                await call
            assert system.names == []
            assert asyncio.all_tasks() == {asyncio.current_task(), system._guardian._task}

    run(body())


def test_proxies_are_built_once_per_ref_and_stay_bound_to_it():
    async def body():
        async with ActorSystem() as system:
            one = await system.spawn(Counter, 1)
            two = await system.spawn(Counter, 2)
            assert one.tell is one.tell
            assert one.ask.add is one.ask.add
            assert await one.ask.add() == 2
            assert await two.ask.add() == 3  # the cached sender of `one` is not shared
            with pytest.raises(UnknownMethod):
                await one.ask._private()
            with pytest.raises(UnknownMethod):
                await one.ask._private()

    run(body())


def test_a_stopped_actor_does_not_keep_its_state_alive():
    import weakref

    class Payload:
        pass

    class Holder(Actor):
        def __init__(self, payload: Payload) -> None:
            self.payload = payload

        def ping(self) -> int:
            return 1

    async def body():
        payload = Payload()
        alive = weakref.ref(payload)
        async with ActorSystem() as system:
            ref = await system.spawn(Holder, payload)
            del payload
            assert await ref.ask.ping() == 1
            await system.stop_actor(ref)
            gc.collect()
            assert alive() is None  # the ref is still held here, the payload is not
            assert not ref.alive

    run(body())


class Ticker(Actor):
    """Runs a background loop owned by the actor; `crash` makes the loop raise."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.crash_now = asyncio.Event()

    async def on_start(self) -> None:
        self.events.append("start")
        self.loop_task = self.context.create_task(self._loop(), name="ticker")

    async def on_stop(self) -> None:
        self.events.append(f"stop (loop cancelled: {self.loop_task.cancelled()})")

    async def _loop(self) -> None:
        await self.crash_now.wait()
        raise RuntimeError("background loop broke")

    def crash(self) -> None:
        self.crash_now.set()

    def ping(self) -> str:
        return "pong"


def test_an_owned_task_that_raises_fails_the_actor_and_it_restarts():
    async def body():
        events: list[str] = []
        async with ActorSystem() as system:
            ref = await system.spawn(Ticker, events, name="ticker")
            await ref.ask.crash()

            await eventually_async(
                lambda: len(system.failures) == 1 and events[-1] == "start", "the actor restarted"
            )
            assert events == ["start", "stop (loop cancelled: False)", "start"]
            assert str(system.failures[0].error) == "background loop broke"
            assert await ref.ask.ping() == "pong"
        assert events[-1] == "stop (loop cancelled: True)"
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_an_owned_task_failing_during_first_on_start_makes_spawn_raise():
    class Early(Actor):
        async def on_start(self) -> None:
            self.context.create_task(self._boom())
            await asyncio.sleep(0.01)

        async def _boom(self) -> None:
            raise OSError("no device")

    async def body():
        async with ActorSystem() as system:
            with pytest.raises(OSError, match="no device"):
                await system.spawn(Early, name="early")
            assert system.names == []
            assert not system.failures

    run(body())


def test_a_stopped_actor_cannot_start_tasks():
    class Keeper(Actor):
        def ctx(self):
            return self.context

    async def idle() -> None:
        await asyncio.sleep(3600)

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Keeper)
            context = await ref.ask.ctx()
            await system.stop_actor(ref)
            coro = idle()
            with pytest.raises(ActorNotFound, match="cannot start tasks"):
                context.create_task(coro)
            assert coro.cr_frame is None  # closed, so no 'never awaited' warning

    run(body())


def test_an_actor_that_stops_itself_in_on_start_is_not_registered():
    events: list[str] = []

    class Quitter(Actor):
        async def on_start(self) -> None:
            await self.context.stop()
            events.append("on_start finished")

        async def on_stop(self) -> None:
            events.append("on_stop")

    async def body():
        async with ActorSystem() as system:
            with pytest.raises(ActorNotFound, match="stopped while it was starting"):
                await system.spawn(Quitter, name="quitter")
            assert system.names == []
            assert events == ["on_stop", "on_start finished"]
            assert asyncio.all_tasks() == {asyncio.current_task(), system._guardian._task}

    run(body())
