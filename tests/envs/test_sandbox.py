"""The sandbox against real bad code: each case costs its episode, and the next one still works."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.envs.sandbox import (
    Limits,
    SandboxClosed,
    SandboxConfigError,
    SandboxPool,
    Status,
    TestCase,
)
from tests.envs.sandbox_cases import GOOD, LIMITS, SQUARE
from tests.support.processes import running, uid_processes
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def pool():
    """One server, so 'the next episode works' is asked of the very server the bad code hit."""
    with SandboxPool(workers=1, limits=LIMITS) as p:
        yield p


def _assert_still_works(pool):
    result = pool.run(GOOD, SQUARE)
    assert result.status is Status.OK, result
    assert result.reward == 1.0


@pytest.mark.timeout(60)
def test_a_correct_solution_earns_full_reward_and_its_output(pool):
    result = pool.run(GOOD + "print('hello from the episode')", SQUARE)
    assert result.status is Status.OK
    assert result.reward == 1.0
    assert result.message == "2/2 tests passed"
    assert result.stdout == "hello from the episode\n"


@pytest.mark.timeout(60)
def test_reward_is_the_fraction_of_tests_passed(pool):
    result = pool.run("def f(x):\n    return 4\n", SQUARE)
    assert result.status is Status.OK
    assert result.reward == 0.5
    assert [t.passed for t in result.tests] == [True, False]
    assert result.tests[1].actual == 4


@pytest.mark.timeout(60)
def test_a_test_that_raises_fails_alone(pool):
    result = pool.run("def f(x):\n    return 1 // (x - 3) * 0 + x * x\n", SQUARE)
    assert result.reward == 0.5
    assert result.tests[1].error.startswith("ZeroDivisionError")


BAD_CODE = {
    "infinite loop": ("while True:\n    pass\n", Status.CPU_LIMIT, "SIGXCPU"),
    "sleeping past the wall clock": ("import time\ntime.sleep(60)\n", Status.TIMEOUT, "wall"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", Status.PROCESS_LIMIT, "BlockingIO"),
    "10 GB allocation": ("x = bytearray(10 * 1024**3)\n", Status.MEMORY_LIMIT, "MemoryError"),
    "segfault": ("import ctypes\nctypes.string_at(0)\n", Status.CRASHED, "SIGSEGV"),
    "os._exit": ("import os\nos._exit(3)\n", Status.EXITED, "status 3"),
    "sys.exit": ("import sys\nsys.exit(0)\n", Status.EXITED, "SystemExit"),
    "huge file": ("open('big', 'wb').write(bytes(8 * 1024**2))\n", Status.FILE_SIZE_LIMIT, "27"),
    "filling the disk": (
        "for i in range(100):\n    open(f'f{i}', 'wb').write(bytes(1024**2))\n",
        Status.DISK_LIMIT,
        "No space left",
    ),
    "running a program it wrote": (
        "import os\nopen('x', 'w').write('#!/bin/sh\\n')\nos.chmod('x', 0o755)\nos.execv('./x', ['x'])\n",
        Status.FORBIDDEN,
        "Permission denied",
    ),
    "reading /etc/shadow": ("print(open('/etc/shadow').read())\n", Status.RUNTIME_ERROR, "shadow"),
    "syntax error": ("def f(:\n", Status.SYNTAX_ERROR, "SyntaxError"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD_CODE))
def test_bad_code_costs_only_its_episode(pool, case):
    source, status, needle = BAD_CODE[case]
    # A generous wall clock for the CPU-bound case: on a loaded machine one CPU second can take
    # several wall seconds, and this test is about RLIMIT_CPU, not the timeout.
    timeout = 60.0 if status is Status.CPU_LIMIT else None
    result = pool.run(GOOD + source, SQUARE, timeout=timeout)
    assert result.status is status, result
    assert needle in result.message
    assert result.reward == 0.0
    assert uid_processes(pool.uids()) == []
    _assert_still_works(pool)


@pytest.mark.timeout(60)
def test_writing_outside_the_episode_directory_is_impossible(pool, tmp_path):
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)
    result = pool.run(f"open({str(target)!r}, 'w').write('x')\n" + GOOD, SQUARE)
    assert result.status is Status.RUNTIME_ERROR
    assert result.reward == 0.0
    assert not target.exists()
    inside = pool.run("open('scratch.txt', 'w').write('ok')\n" + GOOD, SQUARE)
    assert inside.status is Status.OK


@pytest.mark.timeout(60)
def test_a_world_readable_file_outside_cannot_be_read(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    os.chmod(secret, 0o644)
    source = f"def leak():\n    return open({str(secret)!r}).read()\n"
    result = pool.run(source, [TestCase("leak()", "s3cr3t")])
    assert result.reward == 0.0
    assert "FileNotFoundError" in result.tests[0].error
    assert "s3cr3t" not in result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_a_socket_cannot_reach_a_server_on_loopback(pool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = pool.run(source + GOOD, SQUARE)
        assert result.status is Status.NETWORK_BLOCKED, result
        assert result.reward == 0.0
        with pytest.raises(BlockingIOError):
            listener.accept()
    _assert_still_works(pool)


@pytest.mark.timeout(60)
def test_output_is_captured_up_to_the_limit(pool):
    result = pool.run("import sys\nsys.stdout.write('x' * 10**6)\n" + GOOD, SQUARE)
    assert result.status is Status.OK
    assert result.output_truncated
    assert len(result.stdout) == LIMITS.output_bytes


@pytest.mark.timeout(60)
def test_a_descendant_that_escaped_the_session_is_killed(pool):
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(100)\n"
        "    time.sleep(100)\n"
    )
    result = pool.run(source + GOOD, SQUARE)
    assert result.status is Status.OK
    assert uid_processes(pool.uids()) == []


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("Uid:"))
    except OSError:
        return None


def _confined_child(server_pid: int, uid: int) -> int:
    """The server's episode child once it is confined (it changes uid last, after its limits)."""

    def confined() -> int | None:
        try:
            with open(f"/proc/{server_pid}/task/{server_pid}/children") as handle:
                pids = [int(p) for p in handle.read().split()]
        except OSError:
            pids = []
        return next((pid for pid in pids if _uid_of(pid) == uid), None)

    return eventually(confined, "a confined episode child")


def _limits_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/limits") as handle:
        lines = handle.read().splitlines()[1:]
    return {line[:26].strip(): line[26:47].strip() for line in lines}


@pytest.mark.timeout(60)
def test_limits_and_isolation_are_really_applied_to_the_child(pool):
    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.setdefault("r", pool.run("import time\ntime.sleep(3)\n", timeout=30))
    )
    runner.start()
    try:
        child = _confined_child(pool.server_pids()[0], pool.uids()[0])
        limits = _limits_of(child)
        root = os.readlink(f"/proc/{child}/root")
        child_net = os.readlink(f"/proc/{child}/ns/net")
    finally:
        runner.join()
    assert limits["Max cpu time"] == str(LIMITS.cpu_s)
    assert limits["Max address space"] == str(LIMITS.memory_mb * 1024 * 1024)
    assert limits["Max file size"] == str(LIMITS.file_size_mb * 1024 * 1024)
    assert limits["Max open files"] == str(LIMITS.open_files)
    assert limits["Max processes"] == str(LIMITS.processes)
    assert limits["Max core file size"] == "0"
    assert pool.uids()[0] != 0
    assert "/ep-" in root
    assert child_net != os.readlink("/proc/self/ns/net")
    assert outcome["r"].status is Status.OK
    server = pool.server_pids()[0]
    assert os.path.isdir(f"/proc/{server}/root{os.path.dirname(root)}")
    assert not os.path.exists(f"/proc/{server}/root{root}")  # removed, as the server sees it
    assert pool.isolation["network"].startswith("network namespace")
    assert pool.isolation["disk"].startswith("private 4 MiB tmpfs")


@pytest.mark.timeout(60)
def test_a_killed_server_is_replaced():
    with SandboxPool(workers=1, limits=LIMITS) as p:
        (victim,) = p.server_pids()
        os.kill(victim, signal.SIGKILL)
        broken = p.run(GOOD, SQUARE)
        assert broken.status is Status.SANDBOX_ERROR
        assert broken.reward == 0.0
        assert p.server_pids() != [victim]
        _assert_still_works(p)


@pytest.mark.timeout(60)
def test_close_leaves_no_process_behind():
    p = SandboxPool(workers=2, limits=LIMITS)
    servers, uids = p.server_pids(), p.uids()
    p.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\n")
    root = p._tmp.name
    p.close()
    assert not any(running(pid) for pid in servers)
    assert uid_processes(uids) == []
    assert not os.path.exists(root)
    with pytest.raises(SandboxClosed, match="create a new one"):
        p.run(GOOD)


@pytest.mark.timeout(60)
def test_concurrent_runs_from_threads_and_asyncio_get_their_own_results():
    with SandboxPool(workers=2, limits=LIMITS) as p:
        sources = [f"def f(x):\n    return x + {i}\n" for i in range(12)]
        with ThreadPoolExecutor(6) as threads:
            results = list(threads.map(lambda s: p.run(s, [TestCase("f(1)", 1)]), sources))
        assert [r.tests[0].actual for r in results] == [1 + i for i in range(12)]

        async def gather():
            return await asyncio.gather(*(p.run_async(GOOD, SQUARE) for _ in range(4)))

        assert all(r.reward == 1.0 for r in asyncio.run(gather()))


def test_bad_arguments_are_refused_with_the_fix(pool):
    with pytest.raises(SandboxConfigError, match=r"Limits.cpu_s=0: must be an integer ≥ 1"):
        Limits(cpu_s=0)
    with pytest.raises(SandboxConfigError, match=r"Limits\.timeout_s"):
        Limits(timeout_s=float("nan"))
    with pytest.raises(SandboxConfigError, match="workers=0"):
        SandboxPool(workers=0)
    with pytest.raises(SandboxConfigError, match="source must be a str"):
        pool.run(b"print(1)")
    with pytest.raises(SandboxConfigError, match="timeout=-1"):
        pool.run(GOOD, timeout=-1)
    with pytest.raises(SandboxConfigError, match="JSON-serialisable"):
        pool.run(GOOD, [TestCase("f(1)", {1, 2})])


@pytest.mark.timeout(60)
def test_allowed_modules_import_inside_the_chroot_and_others_do_not(pool):
    source = (
        "import random, statistics, dataclasses, decimal, collections\n"
        "def f():\n"
        "    return [statistics.mean([1, 2, 3]), str(decimal.Decimal('0.1') * 3),\n"
        "            random.Random(1).randint(0, 0)]\n"
    )
    result = pool.run(source, [TestCase("f()", [2, "0.3", 0])])
    assert result.status is Status.OK, result
    assert result.reward == 1.0
    refused = pool.run("import sqlite3\n")
    assert refused.status is Status.RUNTIME_ERROR
    assert "ModuleNotFoundError" in refused.message


@pytest.mark.timeout(60)
def test_a_server_replaced_from_a_short_lived_thread_outlives_it():
    """Servers die with the thread that started them (parent-death signal), so the pool must
    not start them from a caller's thread that may end."""
    with SandboxPool(workers=1, limits=LIMITS) as p:

        def kill_and_run() -> None:
            os.kill(p.server_pids()[0], signal.SIGKILL)
            assert p.run(GOOD).status is Status.SANDBOX_ERROR

        caller = threading.Thread(target=kill_and_run)
        caller.start()
        caller.join()
        time.sleep(0.2)
        _assert_still_works(p)
