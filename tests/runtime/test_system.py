"""ActorSystem: names, lookup and paths, remote resolver hook, start/stop, a model-based check."""

import asyncio
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.runtime import Actor, ActorSystem, SupervisorSpec, run, split_path
from shoal.runtime.errors import (
    ActorInterrupted,
    ActorNotFound,
    InvalidActorName,
    InvalidActorPath,
    MailboxFull,
    NameTaken,
    SystemNotRunning,
)
from shoal.runtime.ref import ActorRef

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_asyncio_errors")]


class Echo(Actor):
    def __init__(self, log: list[tuple[str, int, int]] | None = None) -> None:
        self.log = log if log is not None else []

    def echo(self, value: object) -> object:
        return value

    def record(self, sender: int, seq: int) -> tuple[int, int]:
        self.log.append((self.context.name, sender, seq))
        return sender, seq

    async def record_later(self, sender: int, seq: int) -> tuple[int, int]:
        """Suspends before recording, so a stop or a restart can interrupt it."""
        await asyncio.sleep(0)
        return self.record(sender, seq)

    def fail(self, sender: int, seq: int) -> None:
        self.log.append((self.context.name, sender, seq))
        raise RuntimeError("planned failure")


class Remote(ActorRef):
    """A stand-in resolver result: `system.ref` must hand back exactly what the transport made."""

    async def _tell(self, method, args, kwargs):
        raise NotImplementedError

    def _tell_nowait(self, method, args, kwargs):
        raise NotImplementedError

    async def _ask(self, method, args, kwargs, timeout):
        raise NotImplementedError


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,30}", fullmatch=True)
hosts = st.from_regex(r"[a-z0-9.\-]{1,20}", fullmatch=True) | st.just("[::1]")


@given(name=names, host=hosts, port=st.integers(1, 65535))
def test_split_path_round_trips(name, host, port):
    assert split_path(name) == (None, name)
    address = f"shoal://{host}:{port}"
    assert split_path(f"{address}/{name}") == (address, name)


@pytest.mark.parametrize(
    "path",
    ["", "/x", "http://h:1/x", "shoal://h/x", "shoal://h:1/", "shoal://h:1/a/b", "a b", 7],
)
def test_bad_paths(path):
    with pytest.raises(InvalidActorPath, match="shoal://host:port/learner"):
        split_path(path)


def test_names_lookup_and_auto_names():
    async def body():
        async with ActorSystem("unit") as system:
            ref = await system.spawn(Echo, name="echo")
            assert system.lookup("echo") == ref
            assert system.ref("echo") == ref
            assert ref.path == "echo"
            with pytest.raises(NameTaken, match="'echo' already runs"):
                await system.spawn(Echo, name="echo")
            for bad in ("", "$x", "a/b", "a:b", "x" * 201, 5):
                with pytest.raises(InvalidActorName):
                    await system.spawn(Echo, name=bad)
            anon = await system.spawn(Echo)
            assert anon.path.startswith("$Echo-")
            assert system.ref(anon.path) == anon
            with pytest.raises(ActorNotFound, match="live actors: echo, \\$Echo-"):
                system.lookup("missing")
            assert len({ref, system.lookup("echo"), anon}) == 2

    run(body())


def test_spawn_passes_arguments_and_factories():
    async def body():
        log: list[tuple[str, int, int]] = []
        async with ActorSystem() as system:
            ref = await system.spawn(Echo, log=log, name="kw")
            await ref.ask.record(1, 2)
            ref2 = await system.spawn(functools.partial(Echo, log), name="partial")
            await ref2.ask.record(3, 4)
            assert log == [("kw", 1, 2), ("partial", 3, 4)]

    run(body())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mailbox_size": 0}, "mailbox_size"),
        ({"supervisor": {"strategy": "one_for_all"}}, "supervisor"),
    ],
)
def test_bad_spawn_options(kwargs, key):
    async def body():
        async with ActorSystem() as system:
            with pytest.raises(ConfigError, match=key):
                await system.spawn(Echo, **kwargs)
            assert system.names == []

    run(body())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": ""}, "name"),
        ({"hook_timeout": 0}, "hook_timeout"),
        ({"root_supervisor": "one_for_one"}, "root_supervisor"),
        ({"dead_letter_records": -5}, "dead_letter_records"),
    ],
)
def test_bad_system_options(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        ActorSystem(**kwargs)


def test_remote_paths_go_to_the_attached_resolver():
    async def body():
        async with ActorSystem() as system:
            ref = await system.spawn(Echo, name="echo")
            with pytest.raises(ActorNotFound, match="no transport is attached"):
                system.ref("shoal://10.0.0.2:4000/echo")
            with pytest.raises(InvalidActorPath, match="shoal://host:port"):
                system.attach_remote("127.0.0.1:4567", Remote)
            system.attach_remote("shoal://127.0.0.1:4567", Remote)
            assert system.address == "shoal://127.0.0.1:4567"
            assert ref.path == "shoal://127.0.0.1:4567/echo"
            assert system.ref("shoal://127.0.0.1:4567/echo") == ref
            assert system.ref("echo") == ref
            assert ref != Remote(ref.path)  # a local actor is never equal to a remote ref
            remote = system.ref("shoal://127.0.0.1:4568/echo")
            assert isinstance(remote, Remote)
            assert remote.path == "shoal://127.0.0.1:4568/echo"
            system.detach_remote()
            assert ref.path == "echo"
            with pytest.raises(ActorNotFound, match="no transport"):
                system.ref("shoal://127.0.0.1:4568/echo")

    run(body())


def test_transport_can_call_local_primitives_directly():
    async def body():
        async with ActorSystem() as system:
            await system.spawn(Echo, name="echo")
            local = system.ref("echo")
            assert await local._ask("echo", ("x",), {}, 5.0) == "x"
            await local._tell("echo", (1,), {})
            local._tell_nowait("echo", (), {"value": 2})

    run(body())


def test_spawn_needs_a_running_system():
    async def body():
        system = ActorSystem()
        with pytest.raises(SystemNotRunning, match=r"await system\.start"):
            await system.spawn(Echo)
        await system.start()
        await system.stop()
        with pytest.raises(SystemNotRunning):
            await system.spawn(Echo)
        with pytest.raises(SystemNotRunning, match="create a new ActorSystem"):
            await system.start()
        await system.stop()  # idempotent

    run(body())


def test_stop_cancels_every_task_and_counts_leftovers_as_dead_letters():
    class Sleeper(Actor):
        async def nap(self) -> None:
            await asyncio.sleep(3600)

        async def on_start(self) -> None:
            await self.spawn(Echo, name=f"{self.context.name}-child")

    async def body():
        before = asyncio.all_tasks()
        system = ActorSystem()
        await system.start()
        refs = [await system.spawn(Sleeper, name=f"s{i}") for i in range(3)]
        for ref in refs:
            ref.tell_nowait.nap()
            ref.tell_nowait.nap()
            ref.tell_nowait.nap()
        await asyncio.sleep(0.01)
        assert len(asyncio.all_tasks()) == len(before) + 7  # guardian + 6 consumers
        await system.stop()
        assert asyncio.all_tasks() == before
        assert system.names == []
        letters = [d.reason for d in system.dead_letters]
        assert letters.count("interrupted by stop or restart") == 3
        assert letters.count("left in mailbox at stop") == 6
        assert system.dead_letters.total == 9

    run(body(), debug=True)


def test_stop_from_inside_an_actor_does_not_deadlock():
    class Shutdown(Actor):
        async def shutdown(self) -> str:
            await self.context.system.stop()
            return "scheduled"

    async def body():
        system = ActorSystem()
        await system.start()
        ref = await system.spawn(Shutdown)
        assert await ref.ask.shutdown() == "scheduled"
        await system.stop()
        assert not system.running
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_stop_actor_rejects_foreign_refs():
    async def body():
        async with ActorSystem() as one, ActorSystem() as two:
            ref = await one.spawn(Echo)
            with pytest.raises(ActorNotFound, match="not an actor of system"):
                await two.stop_actor(ref)
            with pytest.raises(ActorNotFound):
                await one.stop_actor(Remote("shoal://h:1/x"))

    run(body())


def test_spawn_under_a_stopped_parent_fails():
    class Parent(Actor):
        def ctx(self):
            return self.context

    async def body():
        async with ActorSystem() as system:
            parent = await system.spawn(Parent)
            context = await parent.ask.ctx()
            await system.stop_actor(parent)
            with pytest.raises(ActorNotFound, match="stopping or restarting"):
                await context.spawn(Echo)

    run(body())


class Team(Actor):
    """Supervises three Echo children; a restarted team builds three new ones."""

    def __init__(self, log: list[tuple[str, int, int]], mailbox_size: int) -> None:
        self.log = log
        self.mailbox_size = mailbox_size

    async def on_start(self) -> None:
        for i in range(3):
            await self.spawn(Echo, self.log, name=f"a{i}", mailbox_size=self.mailbox_size)


ops = st.tuples(
    st.sampled_from(["tell", "tell_nowait", "ask", "async_ask", "fail", "stop", "yield"]),
    st.integers(0, 2),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    scripts=st.lists(st.lists(ops, max_size=25), min_size=1, max_size=3),
    mailbox_size=st.integers(1, 4),
    strategy=st.sampled_from(["one_for_one", "one_for_all"]),
    team_max=st.integers(0, 3),
    root_max=st.integers(0, 2),
)
def test_model_nothing_lost_nothing_doubled_order_kept(
    scripts, mailbox_size, strategy, team_max, root_max
):
    """Concurrent senders tell, ask, fail and stop supervised actors at random; afterwards every
    message sent was handled exactly once or counted as a dead letter, in each sender's order."""

    async def body():
        log: list[tuple[str, int, int]] = []
        sent = 0
        system = ActorSystem(root_supervisor=SupervisorSpec(max_restarts=root_max, within=60))
        await system.start()
        team_spec = SupervisorSpec(strategy=strategy, max_restarts=team_max, within=60)
        await system.spawn(Team, log, mailbox_size, name="team", supervisor=team_spec)
        refs = [system.lookup(f"a{i}") for i in range(3)]

        async def sender(who: int, script: list[tuple[str, int]]) -> None:
            nonlocal sent
            for seq, (op, target) in enumerate(script):
                ref = refs[target]
                if op == "tell":
                    await ref.tell.record(who, seq)
                elif op == "tell_nowait":
                    try:
                        ref.tell_nowait.record(who, seq)
                    except MailboxFull:
                        continue
                elif op in ("ask", "async_ask"):
                    method = "record" if op == "ask" else "record_later"
                    try:
                        assert await ref.ask.__getattr__(method)(who, seq) == (who, seq)
                    except (ActorNotFound, ActorInterrupted):
                        pass
                elif op == "fail":
                    await ref.tell.fail(who, seq)
                elif op == "stop":
                    await system.stop_actor(ref)
                    continue
                else:
                    await asyncio.sleep(0)
                    continue
                sent += 1

        await asyncio.gather(*(sender(i, s) for i, s in enumerate(scripts)))
        await system.stop()
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert len(set(log)) == len(log), "a message was handled twice"
        assert len(log) + system.dead_letters.total == sent
        for name in {n for n, _, _ in log}:
            for who in range(len(scripts)):
                seqs = [seq for n, w, seq in log if n == name and w == who]
                assert seqs == sorted(seqs), f"{name} saw sender {who} out of order"

    run(body())


def test_loop_runs_on_uvloop_when_installed():
    from shoal.runtime.loop import new_event_loop, uses_uvloop

    async def loop_kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert uses_uvloop()
    assert run(loop_kind()).startswith("uvloop")
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_stop_during_a_spawn_undoes_it():
    entered = asyncio.Event()
    release = asyncio.Event()
    events: list[str] = []

    class SlowStart(Actor):
        async def on_start(self) -> None:
            entered.set()
            await release.wait()

        async def on_stop(self) -> None:
            events.append("stopped")

    async def body():
        system = ActorSystem()
        await system.start()
        spawning = asyncio.ensure_future(system.spawn(SlowStart, name="late"))
        await entered.wait()
        await system.stop()
        release.set()
        with pytest.raises(ActorNotFound, match="stopped while it was starting"):
            await spawning
        assert events == ["stopped"]
        assert system.names == []
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_stop_from_a_hook_and_a_child_stopping_its_parent_do_not_deadlock():
    class Child(Actor):
        async def stop_parent(self) -> str:
            parent = self.context.parent
            assert parent is not None
            await self.context.stop(parent)
            return "scheduled"

    class Parent(Actor):
        async def on_start(self) -> None:
            await self.spawn(Child, name="child")

        async def on_stop(self) -> None:
            await self.context.system.stop()  # runs in the guardian: must only schedule

    async def body():
        system = ActorSystem()
        await system.start()
        await system.spawn(Parent, name="parent")
        await system.spawn(Echo, name="bystander")
        assert await system.lookup("child").ask.stop_parent() == "scheduled"
        await asyncio.wait_for(system.stop(), 10)
        assert system.names == []
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(body())


def test_plain_asyncio_runs_the_same_system_when_uvloop_is_missing(monkeypatch):
    from shoal.runtime import loop as loop_module

    monkeypatch.setattr(loop_module, "_HAS_UVLOOP", False)

    async def body() -> str:
        async with ActorSystem() as system:
            ref = await system.spawn(Echo, name="echo")
            ref.tell_nowait.record(0, 0)
            assert await ref.ask.echo("plain") == "plain"
        return type(asyncio.get_running_loop()).__module__

    assert not loop_module.uses_uvloop()
    assert run(body()).startswith("asyncio")


def test_spawn_from_another_event_loop_is_refused():
    async def start() -> ActorSystem:
        system = ActorSystem()
        await system.start()
        return system

    async def spawn_elsewhere(system: ActorSystem) -> None:
        with pytest.raises(SystemNotRunning, match="another event loop"):
            await system.spawn(Echo)

    from shoal.runtime.loop import new_event_loop

    home = new_event_loop()
    try:
        system = home.run_until_complete(start())
        run(spawn_elsewhere(system))
        home.run_until_complete(system.stop())
    finally:
        home.close()
