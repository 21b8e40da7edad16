"""`shoal console`: a ptpython REPL with `cluster`, `nodes`, `jobs` and `chaos` preloaded.

Each object is a thin async wrapper over one `CoordinatorClient`, so what an operator types is
what a script would write (`await nodes.list()`), and the REPL runs on the same event loop as
the client (ptpython's `run_async`), which is why a top-level `await` just works.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from shoal.errors import ShoalError
from shoal.local import LocalCluster
from shoal.raft.client import CoordinatorClient


class ConsoleError(ShoalError):
    """The console cannot connect or was asked for something it cannot do; says what to do."""


@dataclass(frozen=True)
class Connection:
    """Where the console points: replica URLs, the token, and the local cluster when there is
    one (only a local cluster's processes can be faulted by `chaos`)."""

    urls: tuple[str, ...]
    token: str
    local: LocalCluster | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConsoleError("no coordinator URLs: pass --coordinators URL[,URL...]")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConsoleError(f"--coordinators: {bad} must be http(s)://HOST:PORT URLs")
        if not self.token:
            raise ConsoleError("the API token is empty: pass --token-file or set $SHOAL_API_TOKEN")


def connect_local(run_dir: Path) -> Connection:
    """The local cluster in `run_dir` (what `shoal up` started)."""
    local = LocalCluster(run_dir)
    if not (local.run_dir / "cluster.json").exists():
        raise ConsoleError(
            f"no cluster in {local.run_dir}; start one with `shoal up`, "
            "or pass --coordinators URLS --token-file FILE"
        )
    return Connection(tuple(local.api_urls()), local.token, local)


def connect_remote(coordinators: str, token_file: Path | None) -> Connection:
    """Coordinators named by URL; the token from a file or $SHOAL_API_TOKEN."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ConsoleError(f"--token-file {token_file}: {exc.strerror}") from None
    else:
        token = os.environ.get("SHOAL_API_TOKEN", "")
    urls = tuple(u.strip().rstrip("/") for u in coordinators.split(",") if u.strip())
    return Connection(urls, token)


class _Wrapper:
    """A `repr` that lists the methods, so typing the object's name is its own help."""

    def __init__(self, client: CoordinatorClient) -> None:
        self._client = client

    def __repr__(self) -> str:
        owner = type(self).__name__.lower()
        lines = [f"{owner}: {_first_line(type(self).__doc__)}"]
        for name, fn in inspect.getmembers(type(self), inspect.isfunction):
            if not name.startswith("_"):
                lines.append(f"  {_usage(owner, name, fn)}")
                lines.append(f"      {_first_line(fn.__doc__)}")
        return "\n".join(lines)


def _usage(owner: str, name: str, fn: Any) -> str:
    """`await nodes.list(liveness=None)`: how to call it, without the type noise."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    shown = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params]
    return f"await {owner}.{name}({', '.join(shown)})"


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


class Cluster(_Wrapper):
    """The control plane: Raft state, the leader, events and checkpoints."""

    async def status(self, consistent: bool = False) -> dict[str, Any]:
        """This replica's view: leader, term, commit index, replicas and their lag."""
        return await self._client.cluster(consistent=consistent)

    async def leader(self) -> str:
        """The leader's API URL."""
        return await self._client.find_leader()

    async def events(self, since: int = 0, wait: float = 0.0) -> list[dict[str, Any]]:
        """Events after `since` (faults, elections, migrations, checkpoints); `wait` long-polls."""
        return list((await self._client.events(since=since, wait=wait))["events"])

    async def checkpoints(self, job: str | None = None) -> list[dict[str, Any]]:
        """Recorded checkpoints, of one job or all."""
        return await self._client.checkpoints(job)

    async def digest(self) -> str:
        """The sha256 of the replicated state (equal on replicas that applied the same log)."""
        return str((await self._client.cluster(digest=True))["digest"])


class Nodes(_Wrapper):
    """The node daemons: list them, look one up, cordon, uncordon or drain it."""

    async def list(self, liveness: str | None = None) -> list[dict[str, Any]]:
        """All nodes, or only those `alive`, `suspect` or `dead`."""
        return await self._client.nodes(liveness=liveness)

    async def get(self, node_id: str) -> dict[str, Any]:
        """One node with its resources, health and the tasks placed on it."""
        return await self._client.node(node_id)

    async def cordon(self, node_id: str) -> dict[str, Any]:
        """Take no new tasks on this node."""
        return await self._client.cordon(node_id)

    async def uncordon(self, node_id: str) -> dict[str, Any]:
        """Take tasks again (also ends a drain)."""
        return await self._client.uncordon(node_id)

    async def drain(self, node_id: str) -> dict[str, Any]:
        """Cordon and move this node's tasks away (before maintenance)."""
        return await self._client.drain(node_id)


class Jobs(_Wrapper):
    """Training jobs and their tasks."""

    async def list(self) -> list[dict[str, Any]]:
        """All jobs."""
        return await self._client.jobs()

    async def get(self, job_id: str) -> dict[str, Any]:
        """One job with its tasks and checkpoints."""
        return await self._client.job(job_id)

    async def submit(
        self,
        spec: dict[str, Any] | None = None,
        tasks: builtins.list[dict[str, Any]] | None = None,
        job_id: str | None = None,
    ) -> dict[str, Any]:
        """Submit a job: a free-form `spec` and task specs (id, kind, actor, args, resources).
        A training job's tasks are what `shoal train --cluster` builds; a job without tasks
        would sit in the cluster doing nothing, so it is refused here."""
        if not tasks:
            raise ConsoleError(
                "a job needs tasks (id, kind, actor, args, resources); to train, run "
                "`shoal train ENV --cluster RUN_DIR`, which builds them"
            )
        return await self._client.submit_job(spec=spec, tasks=tasks, job_id=job_id)

    async def stop(self, job_id: str) -> dict[str, Any]:
        """Stop a job and all its tasks."""
        return await self._client.stop_job(job_id)

    async def tasks(
        self, job: str | None = None, node: str | None = None, state: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        """Tasks, filtered by job, node or state (pending, running, stopped, failed)."""
        return await self._client.tasks(node=node, job=job, state=state)


class Chaos(_Wrapper):
    """Faults on the local cluster's coordinator processes (kill, pause), recorded as events."""

    def __init__(self, client: CoordinatorClient, local: LocalCluster | None) -> None:
        super().__init__(client)
        self._local = local

    def _cluster(self) -> LocalCluster:
        if self._local is None:
            raise ConsoleError(
                "chaos needs a local cluster (shoal console --run-dir DIR); on a remote cluster "
                "run `shoal chaos inject` on the coordinator's host"
            )
        return self._local

    async def _target(self, target: str) -> str:
        local = self._cluster()
        if target not in ("leader", "follower"):
            return local.spec(target).name
        leader_api = await self._client.find_leader()
        names = (
            [s.name for s in local.specs() if s.api_url == leader_api]
            if target == "leader"
            else [s.name for s in local.specs() if s.api_url != leader_api and local.pid(s.name)]
        )
        if not names:
            raise ConsoleError(f"no running {target} to fault")
        return names[0]

    async def kill(self, target: str = "leader") -> str:
        """SIGKILL a replica (`leader`, `follower` or c1, c2, ...) and start it again."""
        from shoal.chaos.faults import KillProcess

        fault = KillProcess(self._cluster(), await self._target(target))
        return await self._record(await asyncio.to_thread(fault.inject))

    async def pause(self, target: str = "leader", seconds: float = 5.0) -> str:
        """SIGSTOP a replica for `seconds`, then SIGCONT it; returns when it is resumed."""
        from shoal.chaos.faults import PauseProcess

        if not 0 < seconds <= 600:
            raise ConsoleError(f"seconds={seconds} must be in (0, 600]")
        fault = PauseProcess(self._cluster(), await self._target(target))
        injected = await asyncio.to_thread(fault.inject)
        started = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            healed = await asyncio.to_thread(fault.heal)
        return await self._record(f"{injected}; {healed} after {time.monotonic() - started:.1f} s")

    async def _record(self, what: str) -> str:
        await self._client.add_event("chaos_console", what, {})
        return what


@dataclass
class Session:
    """The preloaded namespace and the one client behind it (closed when the REPL ends)."""

    client: CoordinatorClient
    cluster: Cluster
    nodes: Nodes
    jobs: Jobs
    chaos: Chaos

    @classmethod
    def open(cls, conn: Connection) -> Session:
        client = CoordinatorClient(list(conn.urls), conn.token)
        return cls(client, Cluster(client), Nodes(client), Jobs(client), Chaos(client, conn.local))

    def namespace(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "nodes": self.nodes,
            "jobs": self.jobs,
            "chaos": self.chaos,
            "client": self.client,
        }


def banner(conn: Connection) -> str:
    where = f"local cluster {conn.local.run_dir}" if conn.local else "coordinators"
    lines = [
        f"shoal console: {where} ({', '.join(conn.urls)})",
        "Top-level await works. Type a name to see its methods, help(name) for details:",
    ]
    for name, cls in (("cluster", Cluster), ("nodes", Nodes), ("jobs", Jobs), ("chaos", Chaos)):
        lines.append(f"  {name:<8} {_first_line(cls.__doc__)}")
    lines.append("  client   the CoordinatorClient underneath (every API call)")
    lines.append("e.g.  await nodes.list()   await jobs.list()   await cluster.events()")
    lines.append("Jobs come from `shoal train --cluster RUN_DIR`; exit() or Ctrl-D leaves.")
    return "\n".join(lines)


class _Leave:
    """`exit()` and `quit()`: ptpython's own exit raises an exception that its asyncio loop does
    not catch (a traceback, and the console stays); SystemExit ends it as Ctrl-D does."""

    def __call__(self) -> NoReturn:
        raise SystemExit(0)

    def __repr__(self) -> str:
        return "Use exit() or Ctrl-D to leave the console"


def _configure(repl: Any) -> None:
    # Ctrl-D ends the console at once, as it ends `python`.
    repl.confirm_exit = False
    add_builtins, show_exception = repl._add_to_namespace, repl._handle_exception

    def add_then_leave() -> None:
        add_builtins()
        namespace = repl.get_globals()
        namespace["exit"] = namespace["quit"] = _Leave()

    def one_line_for_ours(error: BaseException) -> None:
        """The cluster's answers (no such node, refused, not leader) are one line, as the CLI
        prints them; a traceback stays for bugs in what the operator typed."""
        if not isinstance(error, ShoalError):
            show_exception(error)
            return
        print(f"{type(error).__name__}: {error}", flush=True)

    repl._add_to_namespace = add_then_leave
    repl._handle_exception = one_line_for_ours


async def run_console(conn: Connection, history: Path | None) -> None:
    """Run the REPL until EOF (Ctrl-D); the client is closed however it ends."""
    from ptpython.repl import embed

    session = Session.open(conn)
    print(banner(conn), flush=True)
    try:
        await embed(
            globals=session.namespace(),
            return_asyncio_coroutine=True,
            history_filename=str(history) if history else None,
            title="shoal console",
            configure=_configure,
        )
    finally:
        await session.client.close()
