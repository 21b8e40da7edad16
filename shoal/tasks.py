"""Starting and stopping the tasks a coordinator assigns to a node, by import path.

A task names its code as `package.module:Name`, so the runtime never imports the learner.
Two kinds of task:
- an actor (any kind not in `shoal.raft.model.PROCESS_KINDS`): `Name` is an `Actor` subclass,
  built with the task's `args` as keyword arguments (or by `Name.from_task_args(args)` when the
  class defines it) and spawned in the node's own ActorSystem;
- a process (`learner-rank`, `rollout-worker`): `Name` is a function `main(argv) -> int` run in a
  child process (`python -m shoal.tasks module:main ARGV...`), so torch.distributed (or a whole
  rollout worker's ActorSystem) owns that process. `args` may hold `argv` (list of strings) and
  `env` (string map) for it.
Anything wrong with a task (unknown module, a class that is no Actor, bad args) raises
`TaskError` with the reason the node reports as the task's failure message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError
from shoal.process import signal_on_parent_death
from shoal.runtime.actor import Actor
from shoal.runtime.ref import ActorRef
from shoal.runtime.system import ActorSystem

ACTIVE_STATES = ("pending", "running")
_IMPORT_PATH = re.compile(r"(?P<module>[A-Za-z_][\w.]*):(?P<name>[A-Za-z_]\w*)")
LOG_TAIL_BYTES = 4096


class TaskError(ShoalError):
    """A task cannot be started as specified; the message is the reason reported for it."""


@dataclass(frozen=True)
class TaskSpec:
    """One task as the coordinator lists it for this node (only what a node needs)."""

    id: str
    generation: int
    kind: str
    actor: str
    state: str = "pending"
    args: dict[str, Any] = field(default_factory=dict)
    job_id: str = ""
    gpus: tuple[int, ...] = ()
    """The GPU indices on this node the leader's placement gave the task."""

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TaskSpec:
        return cls(
            id=str(record["id"]),
            generation=int(record["generation"]),
            kind=str(record["kind"]),
            actor=str(record["actor"]),
            state=str(record.get("state", "pending")),
            args=dict(record.get("args") or {}),
            job_id=str(record.get("job_id") or ""),
            gpus=tuple(int(g) for g in record.get("gpus") or ()),
        )

    @classmethod
    def copies_for(cls, record: dict[str, Any], node_id: str) -> list[TaskSpec]:
        """The copies of a listed task that `node_id` runs: the current one if it is placed
        here, and a make-before-break migration's incoming one (its own generation, pending
        until it reports) if that is here. The coordinator never puts both on one node."""
        out = []
        if record.get("node", node_id) == node_id:
            out.append(cls.from_record(record))
        incoming = record.get("incoming")
        if isinstance(incoming, dict) and incoming.get("node") == node_id:
            copy = {
                **record,
                "generation": incoming["generation"],
                "state": incoming["state"],
                "gpus": incoming.get("gpus") or [],
            }
            out.append(cls.from_record(copy))
        return out

    @property
    def active(self) -> bool:
        """Whether the coordinator wants this task to run (pending or running)."""
        return self.state in ACTIVE_STATES

    @property
    def key(self) -> tuple[str, int]:
        return self.id, self.generation


def split_import_path(path: str) -> tuple[str, str]:
    match = _IMPORT_PATH.fullmatch(path)
    if match is None:
        raise TaskError(f"import path {path!r} is malformed: write package.module:Name")
    return match["module"], match["name"]


def resolve(path: str) -> Any:
    """The object an import path names; TaskError when the module or the name is missing."""
    module_name, name = split_import_path(path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TaskError(
            f"cannot import module {module_name!r} of {path!r}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise TaskError(f"module {module_name!r} has no {name!r} (task actor {path!r})") from None


def resolve_actor(path: str) -> type[Actor]:
    """The Actor subclass an import path names."""
    obj = resolve(path)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TaskError(
            f"{path!r} is {type(obj).__name__} {obj!r}, not a shoal.runtime.Actor subclass; "
            "an actor task must name an Actor class"
        )
    return obj


def actor_name(task_id: str) -> str:
    """The task's actor name: its id with characters actor names forbid turned into '-'."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", task_id)[:200]


class ActorTask:
    """A task running as an actor in the node's ActorSystem."""

    def __init__(self, spec: TaskSpec, system: ActorSystem) -> None:
        self.spec = spec
        self._system = system
        self.ref: ActorRef | None = None

    async def start(self) -> None:
        cls = resolve_actor(self.spec.actor)
        from_args = getattr(cls, "from_task_args", None)
        factory: Callable[[], Actor]
        if callable(from_args):
            factory = functools.partial(from_args, self.spec.args)
        else:
            try:
                inspect.signature(cls).bind(**self.spec.args)
            except TypeError as exc:
                raise TaskError(
                    f"the task args {sorted(self.spec.args)} do not fit {self.spec.actor}: {exc}"
                ) from None
            factory = functools.partial(cls, **self.spec.args)
        try:
            self.ref = await self._system.spawn(factory, name=actor_name(self.spec.id))
        except Exception as exc:
            raise TaskError(
                f"{self.spec.actor} failed to start: {type(exc).__name__}: {exc}"
            ) from None

    def exited(self) -> str | None:
        """The failure reason if the actor is gone without being stopped by us, else None."""
        if self.ref is None or actor_name(self.spec.id) in self._system.names:
            return None
        name = actor_name(self.spec.id)
        for record in reversed(self._system.failures):
            if record.path.rsplit("/", 1)[-1] == name:
                return f"actor failed: {type(record.error).__name__}: {record.error}"
        return "actor stopped on its own"

    async def stop(self, timeout: float) -> None:
        if self.ref is None:
            return
        with contextlib.suppress(ShoalError, TimeoutError):
            await asyncio.wait_for(self._system.stop_actor(self.ref), timeout)


def _string_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"task args.{what} must be a list of strings, got {value!r}")
    return value


def _string_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise TaskError(f"task args.{what} must be a map of strings to strings, got {value!r}")
    return value


def check_entry(path: str) -> None:
    """Fail early (in the node, not the child) on an entry point whose module does not exist."""
    module_name, _ = split_import_path(path)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise TaskError(f"cannot find module {module_name!r} of {path!r}: {exc}") from None
    if found is None:
        raise TaskError(f"no module {module_name!r} (process entry point {path!r})")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def last_line(path: Path) -> str:
    """The last non-empty line of a log file (the child's own explanation of its exit)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


class ProcessTask:
    """A task running as a child process (a learner rank). Its whole process group is signalled
    so helpers it spawned stop too; the child also gets SIGTERM if the node dies (PDEATHSIG)."""

    def __init__(self, spec: TaskSpec, log_dir: Path, extra_env: dict[str, str]) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{actor_name(spec.id)}.g{spec.generation}.log"
        self._extra_env = extra_env
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        check_entry(self.spec.actor)
        argv = _string_list(self.spec.args.get("argv", []), "argv")
        env = {
            **os.environ,
            **self._extra_env,
            **_string_map(self.spec.args.get("env", {}), "env"),
            "SHOAL_TASK_ID": self.spec.id,
            "SHOAL_TASK_GENERATION": str(self.spec.generation),
            "SHOAL_PARENT_PID": str(os.getpid()),
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A raw descriptor (a local append, no buffering) that the child inherits for its output.
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "shoal.tasks", self.spec.actor, *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise TaskError(f"cannot start {self.spec.actor}: {exc}") from None
        finally:
            os.close(log)

    async def wait(self) -> str | None:
        """Wait for the child to exit; None for a clean exit, else the failure reason."""
        if self.process is None:
            return "never started"
        code = await self.process.wait()
        if code == 0:
            return None
        tail = last_line(self.log_path)
        return describe_exit(code) + (f": {tail}" if tail else "")

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    async def stop(self, timeout: float) -> None:
        """SIGTERM (a learner rank checkpoints and exits), SIGKILL after `timeout` seconds."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.process.wait()


def _die_with_parent() -> None:
    """Ask Linux to send us SIGTERM when the node daemon dies, so no orphan rank lives on."""
    signal_on_parent_death(signal.SIGTERM)
    parent = os.environ.get("SHOAL_PARENT_PID")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        sys.exit(f"shoal task: the node daemon (pid {parent}) is already gone")


def main(argv: list[str]) -> int:
    """The child side: `python -m shoal.tasks module:function ARGS...` runs function(ARGS)."""
    if not argv:
        print("usage: python -m shoal.tasks package.module:function [ARGS...]", file=sys.stderr)
        return 2
    _die_with_parent()
    try:
        entry = resolve(argv[0])
    except TaskError as exc:
        print(f"shoal task: {exc}", file=sys.stderr)
        return 2
    if not callable(entry):
        print(
            f"shoal task: {argv[0]!r} is not callable; name a main(argv) function", file=sys.stderr
        )
        return 2
    result = entry(argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
