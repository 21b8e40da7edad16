"""A replaced learner group meets where its predecessor is still leaving: rank 0 waits for the
rendezvous port, a joining rank that reached the old group's store tries again, and a rank's
transport waits for its fixed port. Real processes, real TCPStore, real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from shoal.learner.errors import LearnerError
from shoal.learner.group import GroupSpec
from shoal.learner.learner_main import listen
from shoal.ports import free_port
from shoal.runtime.actor import Actor
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig
from tests.support.processes import end_group
from tests.support.waiting import eventually, eventually_async

# The old incarnation's rank 0: it holds the group's store (and port) while it "checkpoints".
_OLD_RANK0 = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch.distributed as dist
    store = dist.TCPStore(
        "127.0.0.1", int(sys.argv[1]), 2, True,
        timeout=datetime.timedelta(seconds=30), wait_for_workers=False,
    )
    store.set("shoal/1/ready", "1")
    print("holding", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    """
)

# A rank of the new incarnation: join, agree on a flag, leave.
_NEW_RANK = textwrap.dedent(
    """
    import logging
    from shoal.learner.group import GroupSpec, LearnerGroup
    logging.basicConfig(level=logging.INFO)
    spec = GroupSpec.from_env()
    group = LearnerGroup(spec)
    group.join()
    assert group.all_agree(spec.rank == 1)
    group.leave()
    """
)


@pytest.mark.timeout(120)
def test_a_new_group_forms_once_the_old_rank0_lets_go_of_the_port(tmp_path: Path) -> None:
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        old = subprocess.Popen(
            [sys.executable, "-c", _OLD_RANK0, str(port), str(tmp_path / "release")],
            stdout=subprocess.PIPE,
        )
        procs.append(old)
        assert old.stdout is not None
        assert old.stdout.readline().strip() == b"holding"
        for rank in (1, 0):  # rank 1 first: it reaches the old store before it goes away
            spec = GroupSpec(rank=rank, world_size=2, port=port, backend="gloo", timeout_s=30)
            env = {
                **os.environ,
                **spec.to_env(),
                "SHOAL_TASK_GENERATION": "2",
                "OMP_NUM_THREADS": "1",
            }
            log = (tmp_path / f"rank{rank}.log").open("w")
            procs.append(subprocess.Popen([sys.executable, "-c", _NEW_RANK], env=env, stderr=log))
            log.close()
        # The old rank 0 lets go once the new one has found the port bound (and rank 1,
        # started first, has had the same time to reach the old store).
        _wait_for_line(tmp_path / "rank0.log", "busy", procs[2])
        (tmp_path / "release").touch()
        assert [p.wait(timeout=100) for p in procs[1:]] == [0, 0]
        assert old.wait(timeout=10) == 0
    finally:
        for proc in procs:
            end_group(proc)


# A rank of the old incarnation: it joins its group like any rank; then rank 1 leaves and
# rank 0 keeps the group's store (and port) while it "checkpoints".
_OLD_GROUP_RANK = textwrap.dedent(
    """
    import os, sys, time
    from shoal.learner.group import GroupSpec, LearnerGroup
    spec = GroupSpec.from_env()
    LearnerGroup(spec).join()
    if spec.rank == 0:
        print("formed", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
    """
)


RANK_START_S = 60.0
"""A rank imports torch before it logs a line: on a loaded 2-core machine, tens of seconds."""


def _wait_for_line(log: Path, text: str, rank: subprocess.Popen[bytes]) -> None:
    """Until the still-running `rank` has written `text` to its `log`."""

    def logged() -> bool:
        if text in log.read_text():
            return True
        assert rank.poll() is None, f"the rank exited first: {log.read_text()[-2000:]}"
        return False

    eventually(logged, f"{text!r} in {log.name}", RANK_START_S, detail=log.read_text)


def _start_rank(
    script: str, rank: int, port: int, generation: str, log: Path, *argv: str
) -> subprocess.Popen[bytes]:
    spec = GroupSpec(rank=rank, world_size=2, port=port, backend="gloo", timeout_s=30)
    env = {
        **os.environ,
        **spec.to_env(),
        "SHOAL_TASK_GENERATION": generation,
        "OMP_NUM_THREADS": "1",
    }
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", script, *argv], env=env, stdout=subprocess.PIPE, stderr=out
        )


@pytest.mark.timeout(120)
def test_a_group_restarted_at_the_same_generation_does_not_join_the_old_groups_store(
    tmp_path: Path,
) -> None:
    """A node daemon that is killed and started again before the coordinator declares its
    node dead runs the node's tasks again at the generation they had: the old ranks (SIGTERMed
    when their daemon died) may still be exiting, and the old rank 0 still serves the store
    of the same epoch. The new rank 1 must not take that store, already used by a formed
    group, for its own (it joined the old group's keys and the new rank 0 timed out)."""
    port = free_port()
    release = tmp_path / "release"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        old = [
            _start_rank(_OLD_GROUP_RANK, r, port, "4", tmp_path / f"old{r}.log", str(release))
            for r in (0, 1)
        ]
        procs += old
        assert old[0].stdout is not None
        assert old[0].stdout.readline().strip() == b"formed"
        assert old[1].wait(timeout=30) == 0
        new = [_start_rank(_NEW_RANK, r, port, "4", tmp_path / f"rank{r}.log") for r in (1, 0)]
        procs += new
        _wait_for_line(tmp_path / "rank0.log", "busy", new[1])
        _wait_for_line(tmp_path / "rank1.log", "older group", new[0])
        release.touch()
        codes = [p.wait(timeout=60) for p in new]
        logs = [(tmp_path / f"rank{r}.log").read_text()[-1500:] for r in (1, 0)]
        assert codes == [0, 0], logs
        assert old[0].wait(timeout=10) == 0
    finally:
        for proc in procs:
            end_group(proc)


def test_the_epoch_comes_from_the_task_generation_and_retry_s_is_checked() -> None:
    spec = GroupSpec.from_env({"SHOAL_TASK_GENERATION": "7"})
    assert spec.epoch == "7"
    assert GroupSpec.from_env({}).epoch == ""
    from shoal.errors import ConfigError

    with pytest.raises(ConfigError, match="retry_s = -1"):
        GroupSpec(retry_s=-1)


def _held_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_transport_waits_for_its_port_while_an_old_incarnation_holds_it() -> None:
    sock, port = _held_port()
    release = threading.Timer(1.0, sock.close)

    async def main() -> str:
        async with ActorSystem("rank") as system:
            transport = await listen(system, TransportConfig(token="t" * 32, port=port), 30.0)
            try:
                return transport.address
            finally:
                await transport.close()

    release.start()
    try:
        assert asyncio.run(main()).endswith(f":{port}")
    finally:
        release.cancel()
        sock.close()


@pytest.mark.timeout(60)
def test_a_port_that_stays_taken_fails_with_the_port_and_the_fix() -> None:
    sock, port = _held_port()

    async def main() -> None:
        async with ActorSystem("rank") as system:
            await listen(system, TransportConfig(token="t" * 32, port=port), 0.5)

    try:
        with pytest.raises(LearnerError, match=f"cannot listen on 127.0.0.1:{port}: it stayed"):
            asyncio.run(main())
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_a_rank_leaves_without_waiting_out_a_half_open_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rollout actor that reconnects while a rank closes its links leaves a websocket whose
    handshake never completes; the transport's close would wait out the handshake timeout
    (30 s here, 5 s by default) while the node holds back the group's next incarnation."""
    from shoal.learner.learner_main import CLOSE_LIMIT_S, close_transport
    from shoal.runtime.transport import ROUTE

    config = TransportConfig(token="t" * 32, handshake_timeout=30.0)

    async def main() -> None:
        async with ActorSystem("rank") as system:
            transport = await listen(system, config, 5.0)
            port = int(transport.address.rsplit(":", 1)[1])
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"GET {ROUTE} HTTP/1.1\r\n".encode() + b"Host: 127.0.0.1\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            await writer.drain()
            await asyncio.sleep(0.5)  # the server is inside its handshake now
            try:
                await close_transport(transport)
            finally:
                writer.close()

    with caplog.at_level("INFO", logger="shoal.learner"):
        asyncio.run(main())
    # The close gave up at its own limit: the half-open handshake was not waited out. (The
    # log line is the proof; a stopwatch would be too, but not on a loaded machine.)
    assert f"did not close within {CLOSE_LIMIT_S:.1f} s" in caplog.text


# A rank whose peer never comes, asked to stop (SIGTERM's event) while it waits to join.
_STOPPED_WHILE_JOINING = textwrap.dedent(
    """
    import asyncio
    from shoal.learner.group import GroupSpec, LearnerGroup
    from shoal.learner.learner_main import join_unless_stopped

    async def main():
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stopping.set)
        joined = await join_unless_stopped(LearnerGroup(GroupSpec.from_env()), stopping)
        print("joined" if joined else "left", flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.timeout(900)
def test_a_rank_asked_to_stop_while_its_group_forms_leaves_without_waiting_for_peers() -> None:
    """Its peer died during the restart: the node stops it for the next incarnation, and it
    must go instead of sitting in the rendezvous until the group time-out (or SIGKILL). The
    time-out is long (600 s) so that leaving before it proves the rank did not wait it out,
    however slowly a loaded machine imports torch."""
    spec = GroupSpec(rank=0, world_size=2, port=free_port(), backend="gloo", timeout_s=600)
    env = {**os.environ, **spec.to_env(), "SHOAL_TASK_GENERATION": "3", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_WHILE_JOINING],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=540)  # inside the group's 600 s time-out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "left"


class _Pinged(Actor):
    """A real actor with the learner's `ping`, counting the pings it gets."""

    def __init__(self, pings: list[int]) -> None:
        self.pings = pings

    def ping(self) -> None:
        self.pings.append(1)


@pytest.mark.timeout(60)
def test_a_waiting_rollout_actor_sees_its_learners_link_go_down() -> None:
    """A paced rollout actor waiting for weights checks its link (`_link_stands`): up while
    the learner's process serves, down at once when it is gone, so it registers with the
    next incarnation instead of first waiting out its pace timeout."""
    from shoal.learner.rollout import _link_stands
    from shoal.runtime.transport import attach

    config = TransportConfig(token="t" * 32, reconnect_max=0.25)

    async def main() -> tuple[int, bool]:
        async with ActorSystem("learner") as learner_system, ActorSystem("rollout") as rollout:
            served = await attach(learner_system, config)
            pings: list[int] = []
            await learner_system.spawn(_Pinged, pings, name="learner")
            client = await attach(rollout, config)
            try:
                ref = rollout.ref(f"{served.address}/learner")
                await eventually_async(
                    lambda: _link_stands(ref) and bool(pings), "the link up and pinged"
                )
                await served.close()
                await eventually_async(lambda: not _link_stands(ref), "the link seen down")
                return len(pings), _link_stands(ref)
            finally:
                await client.close()

    pings, up = asyncio.run(main())
    assert pings >= 1
    assert up is False
