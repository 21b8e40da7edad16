"""`shoal console` against a real one-replica local cluster: the wrappers, the REPL driven
through a pseudo-terminal, and the refusals a user can cause."""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.console import (
    Chaos,
    Connection,
    ConsoleError,
    Session,
    banner,
    connect_local,
)
from shoal.local import LocalCluster, coordinator_specs
from shoal.raft.client import CoordinatorClient
from tests.support.waiting import POLL_S, eventually

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("console") / "run")
    cluster.create(coordinator_specs(cluster.run_dir, 1))
    try:
        cluster.start_all()
        cluster.wait_ready()

        async def seed() -> None:
            async with CoordinatorClient(cluster.api_urls(), cluster.token) as client:
                await client.register_node("console-node", "127.0.0.1:1", cpus=4, memory=1 << 30)

        asyncio.run(seed())
        yield cluster
    finally:
        cluster.stop_all()


@given(st.lists(st.text(max_size=12), min_size=1, max_size=4), st.text(max_size=5))
def test_a_connection_takes_only_http_urls_and_a_token(urls: list[str], token: str) -> None:
    valid = all(u.startswith(("http://", "https://")) for u in urls) and token != ""
    if valid:
        assert Connection(tuple(urls), token).urls == tuple(urls)
    else:
        with pytest.raises(ConsoleError, match=r"--coordinators|token"):
            Connection(tuple(urls), token)


def test_the_wrappers_speak_to_the_cluster(local: LocalCluster) -> None:
    async def body() -> None:
        session = Session.open(connect_local(local.run_dir))
        try:
            assert "console-node" in [n["id"] for n in await session.nodes.list()]
            assert (await session.nodes.cordon("console-node"))["cordoned"] is True
            assert (await session.nodes.uncordon("console-node"))["cordoned"] is False
            with pytest.raises(ConsoleError, match="shoal train"):  # no tasks: a job idle for ever
                await session.jobs.submit(spec={"env": "CartPole-v1"})
            job = await session.client.submit_job(spec={"env": "CartPole-v1"}, job_id="console-job")
            assert (await session.jobs.get("console-job"))["spec"] == job["spec"]
            assert await session.cluster.leader() == local.api_urls()[0]
            assert (await session.cluster.status())["state"] == "leader"
            assert len(await session.cluster.digest()) == 64
            assert "job_submitted" in [e["kind"] for e in await session.cluster.events()]
            assert (await session.jobs.stop("console-job"))["state"] == "stopped"
        finally:
            await session.client.close()

    asyncio.run(body())


def test_chaos_pauses_the_leader_and_records_it(local: LocalCluster) -> None:
    async def body() -> list[str]:
        session = Session.open(connect_local(local.run_dir))
        try:
            said = await session.chaos.pause("leader", 0.3)
            assert "c1" in said
            return [e["kind"] for e in await session.cluster.events()]
        finally:
            await session.client.close()

    assert "chaos_console" in asyncio.run(body())


def test_chaos_refuses_a_remote_cluster_and_says_where_to_run_faults() -> None:
    chaos = Chaos(CoordinatorClient(["http://127.0.0.1:9"], "t"), None)
    with pytest.raises(ConsoleError, match="shoal chaos inject"):
        asyncio.run(chaos.kill("leader"))


def test_typing_a_name_lists_its_methods_and_the_banner_lists_the_names(
    local: LocalCluster,
) -> None:
    conn = connect_local(local.run_dir)
    session = Session.open(conn)
    text = repr(session.nodes)
    assert "await nodes.list(liveness=None)" in text
    assert "await nodes.drain(node_id)" in text
    assert all(f"  {name} " in banner(conn) for name in ("cluster", "nodes", "jobs", "chaos"))


class Pty:
    """The console in a pseudo-terminal, as an operator's terminal would run it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.seen = b""
        self.mark = 0
        self.closed = False

    def expect(self, pattern: bytes) -> None:
        """Read until `pattern` shows up after the previous match (ANSI codes stripped)."""

        def shown() -> bool:
            self._read()
            found = ANSI.sub(b"", self.seen).find(pattern, self.mark)
            if found < 0:
                assert not self.closed, f"console ended: {self._unmatched()}"
                return False
            self.mark = found + len(pattern)
            return True

        eventually(shown, f"{pattern!r} on the console", detail=self._unmatched)

    def wait_exit(self) -> int:
        """Drain the terminal while the child exits (a full pty buffer would block its writes)."""

        def exited() -> bool:
            if not self.closed:
                self._read()
            return self.proc.poll() is not None

        eventually(exited, "the console exited", detail=self._unmatched)
        return self.proc.wait()

    def _read(self) -> None:
        """Whatever the console wrote, waiting a moment for it."""
        ready, _, _ = select.select([self.master], [], [], POLL_S)
        if ready:
            try:
                self.seen += os.read(self.master, 65536)
            except OSError:  # the child closed the terminal
                self.closed = True

    def _unmatched(self) -> str:
        return repr(ANSI.sub(b"", self.seen)[self.mark :][-2000:])

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.master)


def test_an_await_typed_at_the_prompt_prints_the_answer(
    local: LocalCluster, tmp_path: Path
) -> None:
    pty = Pty(
        [sys.executable, "-m", "shoal", "console", "--run-dir", str(local.run_dir),
         "--history", str(tmp_path / "history")]
    )  # fmt: skip
    try:
        # Type only at a fresh prompt: between prompts the terminal is in cooked mode, where
        # the line discipline would swallow a Ctrl-D.
        pty.expect(b"Top-level await works")
        pty.expect(b">>>")
        pty.type("[n['id'] for n in await nodes.list()]\r")
        pty.expect(b"['console-node']")
        pty.expect(b">>>")
        pty.type("(await cluster.status())['state'] + '!'\r")
        pty.expect(b"'leader!'")
        pty.expect(b">>>")
        pty.type("await nodes.get('nope')\r")  # the cluster's answer in one line
        pty.expect(b"NotFound: ")
        pty.expect(b">>>")
        pty.type("exit()\r")
        assert pty.wait_exit() == 0
        assert "Traceback" not in ANSI.sub(b"", pty.seen).decode(errors="replace")
        assert "nodes.list()" in (tmp_path / "history").read_text()
    finally:
        pty.close()


def console(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_API_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "shoal", "console", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--run-dir", "/nonexistent/run"), "start one with `shoal up`"),
        (("--coordinators", "127.0.0.1:8001"), "must be http(s)://HOST:PORT"),
        (("--coordinators", "http://127.0.0.1:8001"), "the API token is empty"),
        (("--coordinators", "http://x:1", "--token-file", "/nonexistent"), "--token-file"),
        (("--coordinators", "http://x:1", "--run-dir", "/tmp"), "not both"),
        (("--token-file", "/nonexistent"), "goes with --coordinators"),
    ],
)
def test_bad_connections_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    proc = console(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
