"""Supervision: spec validation, restart intensity, one_for_one vs one_for_all, escalation."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.runtime import Actor, ActorSystem, Strategy, SupervisorSpec, run
from shoal.runtime.errors import ActorInterrupted, ActorNotFound, Escalated, UnknownMethod
from shoal.runtime.supervision import RestartIntensity
from tests.support.waiting import eventually_async

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_asyncio_errors")]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"strategy": "rest_for_one"}, "supervisor.strategy"),
        ({"strategy": 3}, "supervisor.strategy"),
        ({"max_restarts": -1}, "supervisor.max_restarts"),
        ({"max_restarts": 1.5}, "supervisor.max_restarts"),
        ({"max_restarts": True}, "supervisor.max_restarts"),
        ({"within": 0}, "supervisor.within"),
        ({"within": float("inf")}, "supervisor.within"),
        ({"within": "5"}, "supervisor.within"),
    ],
)
def test_bad_spec_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        SupervisorSpec(**kwargs)


def test_spec_accepts_strategy_names():
    assert SupervisorSpec(strategy="one_for_all").strategy is Strategy.ONE_FOR_ALL
    assert SupervisorSpec().strategy is Strategy.ONE_FOR_ONE


@given(
    max_restarts=st.integers(0, 5),
    within=st.floats(0.1, 10),
    gaps=st.lists(st.floats(0, 5), max_size=60),
)
def test_intensity_allows_exactly_max_restarts_per_window(max_restarts, within, gaps):
    """Allowed restarts never exceed the budget in any window; a refusal means the window is full."""
    intensity = RestartIntensity(max_restarts, within)
    now = 0.0
    allowed: list[float] = []
    for gap in gaps:
        now += gap
        in_window = [t for t in allowed if t > now - within]
        if intensity.allow(now):
            assert len(in_window) < max_restarts
            allowed.append(now)
        else:
            assert len(in_window) >= max_restarts


class Kid(Actor):
    """Records its lifecycle into a shared list; `fail` makes it crash."""

    def __init__(self, tag: str, events: list[str]) -> None:
        self.tag = tag
        self.events = events
        self.count = 0

    async def on_start(self) -> None:
        self.events.append(f"start {self.tag}")

    async def on_stop(self) -> None:
        self.events.append(f"stop {self.tag}")

    def bump(self) -> int:
        self.count += 1
        return self.count

    def fail(self) -> None:
        raise RuntimeError(f"{self.tag} broke")


class Boss(Actor):
    """Supervises kids a, b, c; restarted bosses respawn them from scratch."""

    def __init__(self, events: list[str], restarts: list[BaseException]) -> None:
        self.events = events
        self.restarts = restarts

    async def on_start(self) -> None:
        self.events.append("start boss")
        for tag in "abc":
            await self.spawn(Kid, tag, self.events, name=tag)

    async def on_stop(self) -> None:
        self.events.append("stop boss")

    async def on_restart(self, error: Exception) -> None:
        self.restarts.append(error)
        await self.on_start()


async def boss_system(strategy: str, max_restarts: int = 3, root_max: int = 3):
    events: list[str] = []
    restarts: list[BaseException] = []
    system = ActorSystem(root_supervisor=SupervisorSpec(max_restarts=root_max, within=60))
    await system.start()
    spec = SupervisorSpec(strategy=strategy, max_restarts=max_restarts, within=60)
    boss = await system.spawn(Boss, events, restarts, name="boss", supervisor=spec)
    events.clear()
    return system, boss, events, restarts


def test_one_for_one_restarts_only_the_failed_child():
    async def body():
        system, _boss, events, _ = await boss_system("one_for_one")
        try:
            a, b = system.lookup("a"), system.lookup("b")
            assert await b.ask.bump() == 1
            a.tell_nowait.fail()
            assert await a.ask.bump() == 1
            assert await b.ask.bump() == 2  # b kept its state
            assert events == ["stop a", "start a"]
            assert [(f.path, f.action) for f in system.failures] == [("a", "restart")]
        finally:
            await system.stop()

    run(body())


def test_one_for_all_restarts_every_sibling_in_otp_order():
    async def body():
        system, _boss, events, _ = await boss_system("one_for_all")
        try:
            b = system.lookup("b")
            assert await b.ask.bump() == 1
            system.lookup("b").tell_nowait.fail()
            await eventually_async(lambda: len(events) == 6, "all three kids restarted")
            assert events == ["stop c", "stop b", "stop a", "start a", "start b", "start c"]
            assert await b.ask.bump() == 1  # b's state was rebuilt
            assert [f.action for f in system.failures] == ["restart_all"]
        finally:
            await system.stop()

    run(body())


def test_beyond_intensity_the_failure_escalates_to_the_parent():
    async def body():
        system, boss, events, restarts = await boss_system("one_for_one", max_restarts=2)
        try:
            a = system.lookup("a")
            for _ in range(3):
                a.tell_nowait.fail()
                await eventually_async(
                    lambda: not events or events[-1] != "stop a", "a handled fail"
                )
            await eventually_async(lambda: len(restarts) == 1, "boss restarted")
            error = restarts[0]
            assert isinstance(error, Escalated)
            assert isinstance(error.__cause__, RuntimeError)
            assert "restart budget of boss spent (2 restarts within 60s)" in str(error)
            actions = [f.action for f in system.failures]
            assert actions == ["restart", "restart", "escalate", "restart"]
            # the boss's subtree was stopped children-first and built again
            assert events[-8:] == [
                "stop c",
                "stop b",
                "stop a",
                "stop boss",
                "start boss",
                "start a",
                "start b",
                "start c",
            ]
            new_a = system.lookup("a")
            assert new_a != a
            assert await new_a.ask.bump() == 1
            with pytest.raises(ActorNotFound):
                await a.ask.bump()
            assert system.lookup("boss") == boss  # same actor, new incarnation
        finally:
            await system.stop()

    run(body())


def test_at_the_top_the_system_records_the_failure_and_stops_the_subtree():
    async def body():
        system, boss, events, _ = await boss_system("one_for_one", max_restarts=0, root_max=0)
        try:
            system.lookup("c").tell_nowait.fail()
            await eventually_async(lambda: "stop boss" in events, "boss stopped")
            assert events == ["stop c", "stop b", "stop a", "stop boss"]
            assert [(f.path, f.action) for f in system.failures] == [
                ("c", "escalate"),
                ("boss", "stop"),
            ]
            assert isinstance(system.failures[1].error, Escalated)
            assert system.names == []
            with pytest.raises(ActorNotFound):
                await boss.ask.anything()
        finally:
            await system.stop()

    run(body())


def test_a_restart_that_keeps_failing_stops_instead_of_looping():
    class Fragile(Actor):
        starts = 0

        async def on_start(self) -> None:
            Fragile.starts += 1
            if Fragile.starts > 1:
                raise OSError("cannot come back")

        def fail(self) -> None:
            raise RuntimeError("first failure")

    async def body():
        spec = SupervisorSpec(max_restarts=3, within=60)
        async with ActorSystem(root_supervisor=spec) as system:
            ref = await system.spawn(Fragile, name="fragile")
            ref.tell_nowait.fail()
            await eventually_async(lambda: system.names == [], "fragile given up on")
            actions = [f.action for f in system.failures]
            assert actions == ["restart", "restart", "restart", "stop"]
            assert isinstance(system.failures[-1].error, OSError)
            assert Fragile.starts == 4

    run(body())


def test_a_tell_that_fails_restarts_the_actor_without_an_asker():
    async def body():
        events: list[str] = []
        async with ActorSystem() as system:
            ref = await system.spawn(Kid, "k", events)
            await ref.tell.fail()
            assert await ref.ask.bump() == 1
            assert events == ["start k", "stop k", "start k"]

    run(body())


def test_hanging_on_restart_is_cut_by_hook_timeout_and_counts_as_a_failure():
    class Stuck(Actor):
        async def on_restart(self, error: Exception) -> None:
            await asyncio.sleep(3600)

        def fail(self) -> None:
            raise RuntimeError("crash")

    async def body():
        spec = SupervisorSpec(max_restarts=1, within=60)
        async with ActorSystem(root_supervisor=spec, hook_timeout=0.05) as system:
            ref = await system.spawn(Stuck, name="stuck")
            ref.tell_nowait.fail()
            await eventually_async(lambda: system.names == [], "stuck actor given up on")
            assert [f.action for f in system.failures] == ["restart", "stop"]
            assert isinstance(system.failures[-1].error, TimeoutError)

    run(body())


def test_hanging_on_stop_does_not_hang_the_system():
    class SlowStop(Actor):
        async def on_stop(self) -> None:
            await asyncio.sleep(3600)

    async def body():
        system = ActorSystem(hook_timeout=0.05)
        await system.start()
        await system.spawn(SlowStop)
        await asyncio.wait_for(system.stop(), 10)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_a_handler_that_swallows_cancellation_is_abandoned_then_swept():
    release = asyncio.Event()

    class Stubborn(Actor):
        async def hold(self) -> None:
            while not release.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    await release.wait()

    async def body():
        system = ActorSystem(hook_timeout=0.05)
        await system.start()
        ref = await system.spawn(Stubborn, name="stubborn")
        ref.tell_nowait.hold()
        await asyncio.sleep(0.01)
        await asyncio.wait_for(system.stop_actor(ref), 10)
        assert system.names == []
        release.set()
        await asyncio.wait_for(system.stop(), 10)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_cancellation_from_inside_a_handler_is_a_failure_not_a_silent_death():
    class Inner(Actor):
        async def go(self) -> None:
            never = asyncio.get_running_loop().create_future()
            never.cancel()
            await never

        def ping(self) -> str:
            return "pong"

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Inner)
            with pytest.raises(ActorInterrupted, match="cancelled by something it awaited"):
                await ref.ask.go()
            assert await ref.ask.ping() == "pong"
            assert [f.action for f in system.failures] == ["restart"]

    run(body())


def test_messages_for_a_handler_the_new_incarnation_lacks_are_rejected():
    class First(Actor):
        def old(self) -> None:
            raise RuntimeError("switching class")

        def both(self) -> str:
            return "first"

    class Second(Actor):
        def both(self) -> str:
            return "second"

    made: list[type[Actor]] = []

    def factory() -> Actor:
        made.append(First if not made else Second)
        return made[-1]()

    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(factory)
            ref.tell_nowait.old()
            queued = asyncio.ensure_future(ref.ask.old())
            with pytest.raises(UnknownMethod, match="no handler 'old'"):
                await queued
            assert await ref.ask.both() == "second"
            assert [d.reason for d in system.dead_letters] == ["unknown method after restart"]

    run(body())
