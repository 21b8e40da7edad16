"""`shoal bench sandbox`: isolated episodes per second beside what process creation costs anyway.

Baselines, measured in the same run: `subprocess.run([python, "-c", ...])` (a fresh interpreter
per episode, the naive way), and a bare fork+exit loop in an interpreter as small as a sandbox
server (the ceiling: an episode can't be cheaper than one fork). Each sandbox episode is a
trivial program so the figure is the cost of isolation, not of the code. Episodes go one per
`run` call (threads keep every server busy) and, separately, through `run_many` in requests of
`_BATCH`. Rounds of shoal and the fork loop alternate, so load from other work on a shared
machine hits both; CPU time per episode (every process involved) is reported too, since it
depends far less on that load. The CodeGen-v1 row is the real workload: rewards per second of
`score_many` on that env's tasks (a short function body and 5 hidden tests each, through the
env's own pool: the format check, one `run_many`, the verdicts).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from shoal.bench.report import Row
from shoal.envs.codegen import CodeGenEnv
from shoal.envs.sandbox import Limits, SandboxPool, SandboxResult, Status

_FORK_LOOP = """
import os, resource, sys, time
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
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(n * procs / wall, (usage.ru_utime + usage.ru_stime) / (n * procs))
"""

_TICK = os.sysconf("SC_CLK_TCK")
_BATCH = 16


def _bare_fork(episodes: int, procs: int) -> tuple[float, float]:
    """(forks/s, CPU seconds per fork+exit) of a bare loop in a minimal interpreter."""
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _FORK_LOOP, str(episodes // procs), str(procs)],
        capture_output=True,
        text=True,
        check=True,
    )
    rate, cpu = out.stdout.split()
    return float(rate), float(cpu)


def _process_cpu(pid: int) -> float:
    """CPU seconds of `pid` and of the children it reaped (the episode children)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / _TICK


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check(result: SandboxResult) -> None:
    if result.status is not Status.OK:
        raise RuntimeError(f"sandbox benchmark episode failed: {result.message}")


def _sandbox_round(
    pool: SandboxPool, episodes: int, batched: bool
) -> tuple[float, float, list[float]]:
    """(episodes/s, CPU s per episode, latencies) with the pool's servers kept busy."""
    workers = len(pool.server_pids())
    latencies: list[float] = []

    def one(_: int) -> None:
        start = time.perf_counter()
        _check(pool.run("pass"))
        latencies.append(time.perf_counter() - start)

    cpu_before = _own_cpu() + sum(_process_cpu(p) for p in pool.server_pids())
    start = time.perf_counter()
    if batched:
        for result in pool.run_many([("pass", ())] * episodes):
            _check(result)
        latencies.append(time.perf_counter() - start)  # of the whole call, not of an episode
    else:
        with ThreadPoolExecutor(2 * workers) as threads:
            list(threads.map(one, range(episodes)))
    wall = time.perf_counter() - start
    cpu = _own_cpu() + sum(_process_cpu(p) for p in pool.server_pids()) - cpu_before
    return episodes / wall, cpu / episodes, latencies


def _compare(workers: int, episodes: int, rounds: int, batched: bool) -> dict[str, float]:
    shoal_rates, shoal_cpu, fork_rates, fork_cpu = [], [], [], []
    latencies: list[float] = []
    with SandboxPool(workers, Limits(), batch=_BATCH) as pool:
        for _ in range(20):
            pool.run("pass")
        for _ in range(rounds):
            rate, cpu, lat = _sandbox_round(pool, episodes, batched)
            shoal_rates.append(rate)
            shoal_cpu.append(cpu)
            latencies.extend(lat)
            rate, cpu = _bare_fork(episodes, workers)
            fork_rates.append(rate)
            fork_cpu.append(cpu)
    return {
        "rate": statistics.median(shoal_rates),
        "cpu": statistics.median(shoal_cpu),
        "fork_rate": statistics.median(fork_rates),
        "fork_cpu": statistics.median(fork_cpu),
        "p50": statistics.median(latencies),
    }


def _codegen(episodes: int, rounds: int) -> dict[str, float]:
    """Rewards/s of CodeGen-v1 as a rollout worker gets them: `score_many` of reference bodies
    (prompt + body, then 5 hidden tests, one `run_many` through the env's own pool), beside the
    bare fork loop with as many processes as the env has servers."""
    env = CodeGenEnv()
    try:
        tasks = env.tasks("train", episodes, seed=0)
        bodies = [task.reference for task in tasks]
        env.score_many(tasks[:64], bodies[:64])  # starts the pool
        rates, fork_rates = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            scores = env.score_many(tasks, bodies)
            rates.append(len(tasks) / (time.perf_counter() - start))
            bad = [score for score in scores if score.status != "ok" or score.passed != score.total]
            if bad:
                raise RuntimeError(f"a CodeGen-v1 reference failed in the benchmark: {bad[0]}")
            fork_rates.append(_bare_fork(episodes, 2)[0])
    finally:
        env.close()
    return {"rate": statistics.median(rates), "fork_rate": statistics.median(fork_rates)}


def _subprocess_latencies(episodes: int) -> list[float]:
    latencies = []
    for _ in range(episodes):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        latencies.append(time.perf_counter() - start)
    return latencies


def run(quick: bool) -> list[Row]:
    episodes, rounds, naive = (100, 1, 10) if quick else (1000, 5, 100)
    two = _compare(2, episodes, rounds, batched=False)
    one = _compare(1, episodes, rounds, batched=False)
    many = _compare(2, episodes, rounds, batched=True)
    codegen = _codegen(episodes, rounds)
    naive_lat = _subprocess_latencies(naive)
    return [
        Row(
            "isolated episodes/s, 2 servers",
            "1/s",
            two["rate"],
            two["fork_rate"],
            "bare fork+exit, 2 procs",
            True,
        ),
        Row(
            "isolated episodes/s, 1 server",
            "1/s",
            one["rate"],
            one["fork_rate"],
            "bare fork+exit, 1 proc",
            True,
        ),
        Row(
            "isolated episodes/s, 2 servers",
            "1/s",
            two["rate"],
            1.0 / statistics.mean(naive_lat),
            "subprocess.run(python -c)",
            True,
        ),
        Row(
            "CPU per episode, all processes",
            "ms",
            one["cpu"] * 1e3,
            one["fork_cpu"] * 1e3,
            "bare fork+exit",
            False,
        ),
        Row(
            f"isolated episodes/s, 2 servers, run_many (batch {_BATCH})",
            "1/s",
            many["rate"],
            many["fork_rate"],
            "bare fork+exit, 2 procs",
            True,
        ),
        Row(
            f"CPU per episode, run_many (batch {_BATCH})",
            "ms",
            many["cpu"] * 1e3,
            many["fork_cpu"] * 1e3,
            "bare fork+exit",
            False,
        ),
        Row(
            "CodeGen-v1 rewards/s (body + 5 hidden tests, score_many)",
            "1/s",
            codegen["rate"],
            codegen["fork_rate"],
            "bare fork+exit, 2 procs",
            True,
        ),
        Row(
            "episode latency p50, 1 server",
            "ms",
            one["p50"] * 1e3,
            statistics.median(naive_lat) * 1e3,
            "subprocess.run(python -c)",
            False,
        ),
    ]
