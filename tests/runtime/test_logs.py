"""Logging that a peer cannot inflate: the rate limiter's counting as a pure unit, aiohttp's
bad-request reports shortened, and real child processes whose stderr is a file — one flooding
it far past its size limit, one serving a transport port that garbage HTTP requests hit."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.runtime.logs import (
    DEFAULT_MAX_BYTES,
    MAX_BYTES_ENV,
    BadRequestFilter,
    BoundedStderrHandler,
    RateLimiter,
    RateLimitFilter,
    Suppressed,
    configure_logging,
    max_bytes_from,
    reason,
)
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
LEVELS = (logging.INFO, logging.ERROR)
KEYS = [(name, text, level) for name in ("a", "b") for text in ("x %s", "y") for level in LEVELS]


def replay(
    limiter: RateLimiter, records: list[tuple[tuple[str, str, int], float]]
) -> tuple[list[tuple[tuple[str, str, int], float, bool]], list[tuple[Suppressed, float]]]:
    """Feeds `records` in order: each record with its fate, and each summary with when it came."""
    fates, summaries = [], []
    for key, now in records:
        admitted, due = limiter.admit(key, now)
        fates.append((key, now, admitted))
        summaries += [(s, now) for s in due]
    end = records[-1][1] if records else 0.0
    summaries += [(s, end) for s in limiter.drain()]
    return fates, summaries


def timed(increments: list[float], keys: list[tuple[str, str, int]]) -> list:
    now, out = 0.0, []
    for step, key in zip(increments, keys):
        now += step
        out.append((key, now))
    return out


record_streams = st.integers(0, 300).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0, 5, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.sampled_from(KEYS), min_size=n, max_size=n),
    )
)


def most_in_any_window(times: list[float], window: float) -> int:
    times = sorted(times)
    start, most = 0, 0
    for end, t in enumerate(times):
        while times[start] <= t - window:
            start += 1
        most = max(most, end - start + 1)
    return most


@settings(max_examples=300, deadline=None)
@given(stream=record_streams, burst=st.integers(1, 6), window=st.floats(0.5, 20))
def test_limiter_passes_at_most_burst_per_window_and_counts_the_rest(stream, burst, window):
    fates, summaries = replay(RateLimiter(burst, window, max_keys=len(KEYS)), timed(*stream))
    passed: dict[tuple, list[float]] = defaultdict(list)
    for key, now, admitted in fates:
        if admitted:
            passed[key].append(now)
        else:  # dropped only once `burst` of its key passed in the window before it
            recent = [t for t in passed[key] if t > now - window]
            assert len(recent) >= burst
    for times in passed.values():
        assert most_in_any_window(times, window) <= 2 * burst
    counted = Counter(key for key, _, admitted in fates if not admitted)
    for summary, reported in summaries:
        assert summary.count > 0
        counted[summary.key] -= summary.count
        assert summary.start + window <= reported or reported == fates[-1][1]
    assert set(counted.values()) <= {0}  # every dropped record is in exactly one summary
    per_window = Counter((s.key, s.start) for s, _ in summaries)
    assert max(per_window.values(), default=1) == 1


@settings(max_examples=200, deadline=None)
@given(stream=record_streams, burst=st.integers(1, 6), max_keys=st.integers(1, 3))
def test_limiter_bound_holds_for_more_kinds_than_it_tracks(stream, burst, max_keys):
    window = 10.0
    fates, summaries = replay(RateLimiter(burst, window, max_keys), timed(*stream))
    passed_times = [now for _, now, admitted in fates if admitted]
    assert most_in_any_window(passed_times, window) <= 2 * burst * (max_keys + len(LEVELS))
    dropped = sum(1 for *_, admitted in fates if not admitted)
    assert dropped == sum(s.count for s, _ in summaries)


@pytest.mark.parametrize(
    ("burst", "window", "max_keys"), [(0, 1.0, 1), (1, 0.0, 1), (1, float("nan"), 1), (1, 1, 0)]
)
def test_limiter_refuses_a_setting_that_is_not_positive(burst, window, max_keys):
    with pytest.raises(ConfigError, match="must be positive"):
        RateLimiter(burst, window, max_keys)


def test_the_summary_comes_when_the_window_rolls_before_the_next_record():
    now = [0.0]
    out = io.StringIO()
    handler = BoundedStderrHandler(out, max_bytes=0)
    handler.addFilter(RateLimitFilter(RateLimiter(2, 10.0), handler.handle, lambda: now[0]))
    log = logging.getLogger("tests.logs.window")
    log.propagate = False
    log.addHandler(handler)
    try:
        for n in range(5):
            log.warning("refused peer %d", n)
        now[0] = 10.0
        log.warning("refused peer %d", 5)
    finally:
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == [
        "refused peer 0",
        "refused peer 1",
        "suppressed 3 similar messages (more than 2 in 10 s): refused peer %d",
        "refused peer 5",
    ]


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            BadHttpMessage("Invalid header token:\n\n    b'Bad Header'\n         ^"),
            "400 Invalid header token",
        ),
        (LineTooLong("Got more than 8190 bytes when reading: b'yyyy...'."), "400 Got more than"),
        (BadHttpMessage("Missing 'Host' header in request."), "Missing 'Host' header in request"),
    ],
)
def test_a_bad_request_report_becomes_one_line_without_the_request_bytes(exc, expected):
    try:
        raise exc
    except BadHttpMessage:
        info = sys.exc_info()
    record = logging.LogRecord(
        "aiohttp.server",
        logging.ERROR,
        "x",
        1,
        "Error handling request from %s",
        ("1.2.3.4",),
        info,
    )
    assert BadRequestFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "\n" not in text
    assert text.startswith("bad HTTP request from 1.2.3.4: ")
    assert expected in text
    assert "b'" not in text


def test_reason_escapes_and_bounds_what_it_keeps():
    assert reason("\x1b[31mred\u202e " + "z" * 500) == reason("\x1b[31mred\u202e " + "z" * 600)
    assert len(reason("z" * 500)) <= 80
    assert "\x1b" not in reason("\x1b[31mred")


@pytest.mark.parametrize("raw", ["ten", "-1", "100", "1e6"])
def test_a_bad_size_in_the_environment_is_a_config_error(raw):
    with pytest.raises(ConfigError, match=MAX_BYTES_ENV):
        max_bytes_from({MAX_BYTES_ENV: raw})


def test_sizes_from_the_environment():
    assert max_bytes_from({}) == DEFAULT_MAX_BYTES
    assert max_bytes_from({MAX_BYTES_ENV: "0"}) == 0
    assert max_bytes_from({MAX_BYTES_ENV: " 65536 "}) == 65536


def test_an_unknown_level_or_a_tiny_size_is_a_config_error():
    with pytest.raises(ConfigError, match="'LOUD' is unknown"):
        configure_logging("LOUD", environ={})
    with pytest.raises(ConfigError, match="max_bytes=10 is not a log size"):
        configure_logging("INFO", max_bytes=10)


FLOOD = """
import logging, sys
from shoal.runtime.logs import configure_logging

lines = int(sys.argv[1])
configure_logging("INFO", burst=lines + 1)
log = logging.getLogger("flood")
for n in range(lines):
    log.info("line %06d %s", n, "x" * 100)
"""
LINE = re.compile(rb"line (\d{6}) x+$")


def open_like(how: str, path: Path) -> int:
    """stderr opened as shoal's parents open it (shoal/tasks.py, shoal/local.py), or without
    O_APPEND at all."""
    flags = {"O_APPEND": os.O_APPEND, "ab": os.O_APPEND, "no append": os.O_TRUNC}[how]
    return os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)


def numbers(path: Path) -> list[int]:
    return [int(m[1]) for line in path.read_bytes().splitlines() if (m := LINE.search(line))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["O_APPEND", "ab", "no append"])
def test_a_child_flooding_its_log_leaves_files_within_the_bound(tmp_path, how):
    limit, lines = 16 * 1024, 3000  # about 25 times the limit
    log = tmp_path / "task.log"
    fd = open_like(how, log)
    try:
        env = {**os.environ, MAX_BYTES_ENV: str(limit)}
        done = subprocess.run(
            [sys.executable, "-c", FLOOD, str(lines)],
            stdout=fd,
            stderr=fd,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            check=False,
        )
    finally:
        os.close(fd)
    assert done.returncode == 0, log.read_text()[-2000:]
    copy = log.with_name("task.log.1")
    record = 200  # one record and the truncation note, with room to spare
    assert log.stat().st_size <= limit + 2 * record
    assert copy.stat().st_size <= limit + 2 * record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.log", "task.log.1"]
    live, older = numbers(log), numbers(copy)
    assert live[-1] == lines - 1  # the newest line is in the live file
    assert older + live == list(range(older[0], lines))  # nothing lost at the cut
    assert b"the earlier lines are in " + bytes(copy) in log.read_bytes()
    assert not log.read_bytes().startswith(b"\0")  # no hole where the old end was


SERVER = """
import asyncio, math, sys
from shoal.runtime.actor import Actor
from shoal.runtime.logs import configure_logging
from shoal.runtime.loop import run
from shoal.runtime.system import ActorSystem
from shoal.runtime.transport import TransportConfig, attach

class Echo(Actor):
    def echo(self, value):
        return value

async def main():
    configure_logging("INFO", burst=int(sys.argv[2]), window=math.inf)
    async with ActorSystem() as system:
        await system.spawn(Echo, name="echo")
        transport = await attach(system, TransportConfig(token=sys.argv[1]))
        print(transport.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await transport.close()

run(main())
"""
TOKEN = "log-token"
BURST = 10
# Each a malformed request aiohttp reports at ERROR level, quoting the bytes it choked on.
GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /\x00evil HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 9000 + b"\r\n\r\n",
]
ROUNDS = 60  # 300 requests


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """A child serving an echo actor, its stderr a file opened as shoal/tasks.py opens it."""
    log = tmp_path / "node.log"
    fd = open_like("O_APPEND", log)
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, TOKEN, str(BURST)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=fd,
        text=True,
        cwd=ROOT,
    )
    os.close(fd)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("shoal://127.0.0.1:"), log.read_text()
        yield proc, address, log
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


async def bad_request(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await reader.read()  # the server answers 400 and closes
    finally:
        writer.close()


@pytest.mark.timeout(180)
def test_garbage_http_requests_cost_a_bounded_number_of_log_lines(server):
    proc, address, log = server
    host, port = address.removeprefix("shoal://").rsplit(":", 1)

    async def main() -> None:
        for _ in range(ROUNDS):
            answers = await asyncio.gather(*(bad_request(host, int(port), g) for g in GARBAGE))
            assert all(a.startswith(b"HTTP/1.0 400") for a in answers), answers
        async with ActorSystem() as system:
            transport = await attach(system, TransportConfig(token=TOKEN))
            try:
                assert await system.ref(f"{address}/echo").ask.echo("still here") == "still here"
            finally:
                await transport.close()

    run(main())
    assert proc.stdin is not None
    proc.stdin.close()  # the child exits and logs what it suppressed
    eventually(lambda: proc.poll() is not None, "the server child exits")
    assert proc.returncode == 0, log.read_text()[-2000:]
    text = log.read_text()
    reports = [line for line in text.splitlines() if "bad HTTP request from 127.0.0.1: 400" in line]
    total = ROUNDS * len(GARBAGE)
    assert len(reports) == BURST
    assert f"suppressed {total - BURST} similar messages" in text
    assert "Traceback" not in text
    for quoted in ("Bad Header", "yyyy", "evil"):  # the bytes aiohttp quotes stay out
        assert quoted not in text
    line_bound = 300  # one report, or the summary: a timestamp, a logger and a short reason
    assert max(len(line) for line in reports) <= line_bound
    assert log.stat().st_size <= (BURST + 1) * line_bound + 4096  # 4 KiB: start-up lines
