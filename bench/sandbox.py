"""`shoal bench sandbox`: isolated episodes per second beside what process creation costs anyway.

Baselines, measured in the same run: `subprocess.run([python, "-c", ...])` (a fresh interpreter
per episode, the naive way), and a bare fork+exit loop in an interpreter as small as a sandbox
server (the ceiling: an episode can't be cheaper than one fork). Each sandbox episode is a
trivial program so the figure is the cost of isolation, not of the code.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from shoal.bench.report import Row
from shoal.envs.sandbox import Limits, SandboxPool, Status

_FORK_LOOP = """
import os, sys, time
n, procs = int(sys.argv[1]), int(sys.argv[2])
def loop():
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
start = time.perf_counter()
workers = []
for _ in range(procs):
    pid = os.fork()
    if pid == 0:
        loop()
        os._exit(0)
    workers.append(pid)
for pid in workers:
    os.waitpid(pid, 0)
print(n * procs / (time.perf_counter() - start))
"""


def _bare_fork_rate(episodes: int, procs: int) -> float:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _FORK_LOOP, str(episodes // procs), str(procs)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def _subprocess_latencies(episodes: int) -> list[float]:
    latencies = []
    for _ in range(episodes):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        latencies.append(time.perf_counter() - start)
    return latencies


def _sandbox_rate(workers: int, episodes: int) -> tuple[float, list[float]]:
    """Episodes/s with `workers` servers kept busy by twice as many client threads."""
    with SandboxPool(workers, Limits()) as pool:
        for _ in range(20):
            pool.run("pass")
        latencies: list[float] = []

        def one(_: int) -> None:
            start = time.perf_counter()
            result = pool.run("pass")
            latencies.append(time.perf_counter() - start)
            if result.status is not Status.OK:
                raise RuntimeError(f"sandbox benchmark episode failed: {result.message}")

        start = time.perf_counter()
        with ThreadPoolExecutor(2 * workers) as threads:
            list(threads.map(one, range(episodes)))
        return episodes / (time.perf_counter() - start), latencies


def run(quick: bool) -> list[Row]:
    episodes = 200 if quick else 4000
    naive = 10 if quick else 100
    rate2, _ = _sandbox_rate(2, episodes)
    rate1, latencies = _sandbox_rate(1, episodes // 2)
    naive_lat = _subprocess_latencies(naive)
    fork2 = _bare_fork_rate(episodes, 2)
    fork1 = _bare_fork_rate(episodes // 2, 1)
    return [
        Row("isolated episodes/s, 2 servers", "1/s", rate2, fork2, "bare fork+exit, 2 procs", True),
        Row("isolated episodes/s, 1 server", "1/s", rate1, fork1, "bare fork+exit, 1 proc", True),
        Row(
            "isolated episodes/s, 2 servers",
            "1/s",
            rate2,
            1.0 / statistics.mean(naive_lat),
            "subprocess.run(python -c)",
            True,
        ),
        Row(
            "episode latency p50, 1 server",
            "ms",
            statistics.median(latencies) * 1e3,
            statistics.median(naive_lat) * 1e3,
            "subprocess.run(python -c)",
            False,
        ),
    ]
