"""Tasks by import path: actors in a real ActorSystem, learner ranks as real child processes.

This module also holds the task code the node tests start (`test_node_tasks:Echo`,
`test_node_tasks:sleeper`, ...): node daemons import it with tests/shoal on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from shoal.runtime.actor import Actor
from shoal.runtime.system import ActorSystem
from shoal.tasks import (
    ActorTask,
    ProcessTask,
    TaskError,
    TaskSpec,
    actor_name,
    describe_exit,
    main,
    resolve_actor,
)
from tests.support.waiting import eventually

HERE = Path(__file__).parent


# -- task code the tests (and the node daemons of test_node_cluster) start ------------------


class Echo(Actor):
    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting

    def hello(self, who: str) -> str:
        return f"{self.greeting} {who}"


class FailsToStart(Actor):
    async def on_start(self) -> None:
        raise RuntimeError("no GPU here")


class SlowStart(Actor):
    """Takes its time in on_start, as a rollout actor building many environments does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def on_start(self) -> None:
        await asyncio.sleep(self.seconds)

    def ready(self) -> bool:
        return True


class Crasher(Actor):
    def crash(self) -> None:
        raise RuntimeError("boom")


class NotAnActor:
    pass


def sleeper(argv: list[str]) -> int:
    """Runs until SIGTERM, then writes `<argv[0]>.g<generation>` (as a learner rank would
    checkpoint) and exits 0; `<that>.pid` says it is up."""
    marker = Path(f"{argv[0]}.g{os.environ['SHOAL_TASK_GENERATION']}")

    def on_term(signum: int, frame: object) -> None:
        marker.write_text(f"terminated {os.getpid()}")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    Path(f"{marker}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def stubborn(argv: list[str]) -> int:
    """Ignores SIGTERM (a rank stuck in a collective), so only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(argv[0]).write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def fail_fast(argv: list[str]) -> int:
    print(f"bad rank config: {' '.join(argv)}", file=sys.stderr)
    return 3


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `test_node_tasks:...` importable here as it is in the node's children."""
    monkeypatch.syspath_prepend(str(HERE))


def spec(actor: str, kind: str = "rollout", generation: int = 1, **args: object) -> TaskSpec:
    return TaskSpec("t-1", generation, kind, actor, "pending", dict(args))


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{HERE}{os.pathsep}{path}" if path else str(HERE)}


def wait_for_file(path: Path) -> None:
    eventually(path.exists, f"{path} written")


# -- import paths -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
        ("test_node_tasks:Missing", "has no 'Missing'"),
        ("test_node_tasks:NotAnActor", "not a shoal.runtime.Actor subclass"),
        ("test_node_tasks:sleeper", "not a shoal.runtime.Actor subclass"),
        ("not an import path", "malformed"),
    ],
)
def test_bad_actor_paths_name_the_problem(path: str, fragment: str) -> None:
    with pytest.raises(TaskError, match=fragment):
        resolve_actor(path)


def test_actor_path_resolves_to_the_class() -> None:
    assert resolve_actor("test_node_tasks:Echo").__name__ == "Echo"


def test_actor_names_keep_only_allowed_characters() -> None:
    assert actor_name("job-1/rollout:0@x") == "job-1-rollout-0-x"


def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


# -- actor tasks --------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_actor_task_runs_with_args_and_stops() -> None:
    async def go() -> None:
        async with ActorSystem("t") as system:
            task = ActorTask(spec("test_node_tasks:Echo", greeting="hi"), system)
            await task.start()
            assert task.ref is not None
            assert await task.ref.ask.hello("node") == "hi node"
            assert task.exited() is None
            await task.stop(5.0)
            assert "t-1" not in system.names

    asyncio.run(go())


@pytest.mark.timeout(30)
def test_an_actor_the_system_gave_up_on_has_exited_with_its_error() -> None:
    async def go() -> str | None:
        async with ActorSystem("t") as system:
            task = ActorTask(spec("test_node_tasks:Crasher"), system)
            await task.start()
            assert task.ref is not None
            while task.exited() is None:  # each crash is a restart, until the budget is spent
                await task.ref.tell.crash()
                await asyncio.sleep(0.01)
            return task.exited()

    assert asyncio.run(go()) == "actor failed: RuntimeError: boom"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("actor", "args", "fragment"),
    [
        ("test_node_tasks:Echo", {"colour": "red"}, "args \\['colour'\\] do not fit .*'colour'"),
        ("test_node_tasks:SlowStart", {}, "do not fit .*missing a required argument: 'seconds'"),
        ("test_node_tasks:FailsToStart", {}, "failed to start: RuntimeError: no GPU here"),
        ("test_node_tasks:NotAnActor", {}, "not a shoal.runtime.Actor"),
    ],
)
def test_actor_task_that_cannot_start_is_a_task_error(
    actor: str, args: dict[str, object], fragment: str
) -> None:
    async def go() -> None:
        async with ActorSystem("t") as system:
            with pytest.raises(TaskError, match=fragment):
                await ActorTask(spec(actor, **args), system).start()
            assert system.names == []

    asyncio.run(go())


# -- process tasks ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_process_task_failure_reports_status_and_last_line(tmp_path: Path) -> None:
    async def go() -> str | None:
        task = ProcessTask(
            spec("test_node_tasks:fail_fast", "learner-rank", argv=["--lr", "x"]),
            tmp_path,
            child_env(),
        )
        await task.start()
        return await task.wait()

    assert asyncio.run(go()) == "exited with status 3: bad rank config: --lr x"


@pytest.mark.timeout(60)
def test_process_task_stop_sends_sigterm_first(tmp_path: Path) -> None:
    base = tmp_path / "marker"
    marker = Path(f"{base}.g1")

    async def go() -> str | None:
        task = ProcessTask(
            spec("test_node_tasks:sleeper", "learner-rank", argv=[str(base)]),
            tmp_path,
            child_env(),
        )
        await task.start()
        try:
            await asyncio.to_thread(wait_for_file, Path(f"{marker}.pid"))
        finally:
            await task.stop(20.0)
        return await task.wait()

    assert asyncio.run(go()) is None
    assert marker.read_text().startswith("terminated")


@pytest.mark.timeout(60)
def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    ready = tmp_path / "ready"

    async def go() -> str | None:
        task = ProcessTask(
            spec("test_node_tasks:stubborn", "learner-rank", argv=[str(ready)]),
            tmp_path,
            child_env(),
        )
        await task.start()
        try:
            await asyncio.to_thread(wait_for_file, ready)
        finally:
            await task.stop(0.5)
        return await task.wait()

    assert asyncio.run(go()) == "killed by SIGKILL"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("actor", "args", "fragment"),
    [
        ("no_such_module_xyz:main", {}, "no module 'no_such_module_xyz'"),
        ("test_node_tasks:fail_fast", {"argv": "--lr 3"}, "args.argv must be a list of strings"),
        ("test_node_tasks:fail_fast", {"env": {"A": 1}}, "args.env must be a map"),
    ],
)
def test_process_task_refuses_bad_specs_before_forking(
    tmp_path: Path, actor: str, args: dict[str, object], fragment: str
) -> None:
    task = ProcessTask(spec(actor, "learner-rank", **args), tmp_path, child_env())
    with pytest.raises(TaskError, match=fragment):
        asyncio.run(task.start())
    assert task.process is None


def test_child_launcher_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["test_node_tasks:Missing"]) == 2
    assert "has no 'Missing'" in capsys.readouterr().err
    assert main(["test_node_tasks:HERE"]) == 2
    assert "not callable" in capsys.readouterr().err
