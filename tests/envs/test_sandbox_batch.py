"""`run_many`: episodes of one request run at once in one server, and are as isolated from each
other as episodes run one after another (a uid, a tmpfs, network and IPC namespaces each)."""

from __future__ import annotations

import pytest

from shoal.envs.sandbox import (
    SandboxConfigError,
    SandboxPool,
    Status,
    TestCase,
)
from tests.envs.sandbox_cases import GOOD, LIMITS, SQUARE
from tests.support.processes import uid_processes


@pytest.fixture(scope="module")
def pool():
    """One server with 4 slots, so every episode of a request shares the server with the others."""
    with SandboxPool(workers=1, limits=LIMITS, batch=4) as p:
        yield p


@pytest.mark.timeout(60)
def test_results_come_back_in_order_each_judged_alone(pool):
    episodes = [
        (GOOD, SQUARE),
        ("def f(x):\n    return 4\n", SQUARE),
        ("def f(:\n", SQUARE),
        ("import time\ntime.sleep(60)\n", SQUARE),
        ("x = bytearray(10 * 1024**3)\n", SQUARE),
        (GOOD + "print('seven')", SQUARE),
    ]
    results = pool.run_many(episodes, timeout=3)
    assert [r.status for r in results] == [
        Status.OK,
        Status.OK,
        Status.SYNTAX_ERROR,
        Status.TIMEOUT,
        Status.MEMORY_LIMIT,
        Status.OK,
    ]
    assert [r.reward for r in results] == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0]
    assert results[5].stdout == "seven\n"
    assert uid_processes(pool.uids()) == []


@pytest.mark.timeout(60)
def test_episodes_running_at_once_have_a_uid_root_and_network_of_their_own(pool):
    source = (
        "import os, socket\n"
        "def who():\n"
        "    return [os.getuid(), os.getcwd(), sorted(os.listdir('/'))]\n"
        "open('mine', 'w').write('x')\n"
    )
    results = pool.run_many([(source, [TestCase("who()", None)])] * 4)
    seen = [r.tests[0].actual for r in results]
    assert len({uid for uid, _, _ in seen}) == 4
    assert set(pool.uids()) >= {uid for uid, _, _ in seen}
    assert all(cwd == "/" and listing == ["mine"] for _, cwd, listing in seen)


@pytest.mark.timeout(60)
def test_a_fork_bomb_does_not_use_up_a_neighbours_processes(pool):
    neighbour = (
        "import os, time\n"
        "time.sleep(0.5)\n"
        "pids = [os.fork() for _ in range(3)]\n"
        "if 0 in pids:\n"
        "    os._exit(0)\n"
        "for pid in pids:\n"
        "    os.waitpid(pid, 0)\n" + GOOD
    )
    bomb = "import os\nwhile True:\n    os.fork()\n"
    results = pool.run_many([(bomb, SQUARE), (neighbour, SQUARE)], timeout=10)
    assert results[0].status is Status.PROCESS_LIMIT, results[0]
    assert results[1].status is Status.OK, results[1]
    assert results[1].reward == 1.0


@pytest.mark.timeout(60)
def test_filling_the_disk_leaves_a_neighbour_its_own(pool):
    filler = "for i in range(100):\n    open(f'f{i}', 'wb').write(bytes(1024**2))\n"
    writer = (
        "import time\ntime.sleep(0.5)\n"
        "open('data', 'wb').write(bytes(3 * 1024**2 // 4))\n"
        "open('more', 'wb').write(bytes(3 * 1024**2 // 4))\n" + GOOD
    )
    results = pool.run_many([(filler, SQUARE), (writer, SQUARE)], timeout=10)
    assert results[0].status is Status.DISK_LIMIT, results[0]
    assert results[1].status is Status.OK, results[1]


@pytest.mark.timeout(60)
def test_episodes_running_at_once_cannot_reach_each_other(pool):
    """An abstract unix socket needs no interface, only a shared network namespace; a System V
    shared memory segment only a shared IPC namespace. Each slot has its own of both."""
    listener = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind('\\0shoal-batch-test')\n"
        "s.listen()\n"
        "s.settimeout(2)\n"
        "def heard():\n"
        "    try:\n"
        "        s.accept()\n"
        "        return True\n"
        "    except OSError:\n"
        "        return False\n"
    )
    caller = (
        "import socket, time\n"
        "def reached():\n"
        "    for _ in range(20):\n"
        "        try:\n"
        "            socket.socket(socket.AF_UNIX).connect('\\0shoal-batch-test')\n"
        "            return True\n"
        "        except OSError:\n"
        "            time.sleep(0.05)\n"
        "    return False\n"
    )
    shm = (
        "import ctypes, time\n"
        "libc = ctypes.CDLL(None)\n"
        "def made():\n"
        "    shm = libc.shmget(0x5a0a1, 4096, 0o1666)\n"  # IPC_CREAT | 0666
        "    time.sleep(1.5)\n"
        "    return shm >= 0 and libc.shmctl(shm, 0, None) == 0\n"  # IPC_RMID
        "def found():\n"
        "    for _ in range(20):\n"
        "        if libc.shmget(0x5a0a1, 0, 0) >= 0:\n"
        "            return True\n"
        "        time.sleep(0.05)\n"
        "    return False\n"
    )
    results = pool.run_many(
        [
            (listener, [TestCase("heard()", False)]),
            (caller, [TestCase("reached()", False)]),
            (shm, [TestCase("made()", True)]),
            (shm, [TestCase("found()", False)]),
        ],
        timeout=10,
    )
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 1.0], results


@pytest.mark.timeout(60)
def test_descendants_that_escaped_are_killed_before_the_slots_are_reused(pool):
    escape = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(100)\n"
        "    time.sleep(100)\n" + GOOD
    )
    results = pool.run_many([(escape, SQUARE)] * 4)
    assert all(r.status is Status.OK for r in results), results
    assert uid_processes(pool.uids()) == []
    assert all(r.reward == 1.0 for r in pool.run_many([(GOOD, SQUARE)] * 4))


@pytest.mark.timeout(60)
def test_many_episodes_are_spread_over_requests_and_servers():
    with SandboxPool(workers=2, limits=LIMITS, batch=3) as p:
        results = p.run_many([(f"def f(x):\n    return x * {i}\n", SQUARE) for i in range(11)])
        assert [r.reward for r in results] == [0.0, 0.0, 0.5, 0.5] + [0.0] * 7
        assert len(set(p.uids())) == 6


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_with_a_clear_error(pool):
    with pytest.raises(SandboxConfigError, match=r"\(source, tests\) tuple"):
        pool.run_many(["pass"])  # type: ignore[list-item]
    with pytest.raises(SandboxConfigError, match="source must be a str"):
        pool.run_many([(b"pass", [])])  # type: ignore[list-item]
    with pytest.raises(SandboxConfigError, match="timeout"):
        pool.run_many([("pass", [])], timeout=0)
    for batch in (0, 65, True, 2.0):
        with pytest.raises(SandboxConfigError, match="batch="):
            SandboxPool(workers=1, limits=LIMITS, batch=batch)  # type: ignore[arg-type]
    with pytest.raises(SandboxConfigError, match="sequence of TestCase"):
        pool.run_many([("pass", None)])  # type: ignore[list-item]
    assert pool.run_many([]) == []
    assert pool.run_many([(GOOD, iter(SQUARE))])[0].reward == 1.0
