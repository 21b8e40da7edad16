"""CleanRL's own `cleanrl/ppo.py` (discrete actions) and `cleanrl/ppo_continuous_action.py`, run
unmodified from a checkout of CleanRL as a subprocess, for the learning bench's third trainer
column: the argv for one seed and step budget, and a bounded parser of the
`global_step=…, episodic_return=[…]` lines both print (outside bytes: each line and the number of
lines are capped, a malformed episode line is a `MalformedOutput`, never a crash).

CleanRL is not a pip package and pins gymnasium 0.29 (its `final_info` handling predates 1.x), so
it runs under its own interpreter (`Checkout.python`), in a scratch folder (both write their
TensorBoard log to `runs/`; neither saves its model unless given `--save-model`).
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PPO = Path("cleanrl") / "ppo.py"
PPO_CONTINUOUS = Path("cleanrl") / "ppo_continuous_action.py"
"""The scripts, relative to a checkout; both take `--env-id`, `--total-timesteps`, `--seed` and
`--no-cuda` and print one `global_step=N, episodic_return=[R]` line per finished episode."""
WINDOW = 20
"""Episodes in the final return: the last 20, as shoal's cells and the CleanRL-style loop."""
MAX_LINE = 4096
"""Bytes in one stdout line, newline excluded; the scripts' lines are under 60."""
MAX_LINES = 1_000_000
"""Stdout lines in one run; ppo.py prints one per episode (CartPole's shortest is about 8 steps)
and one per 512-step iteration, so 1M lines covers budgets up to about 8M steps;
ppo_continuous_action.py prints one per episode (Hopper's shortest are about 10 steps) and one
per 2048-step iteration."""
STDERR_TAIL = 2000
"""Bytes of a failed run's stderr quoted in its error."""

_EPISODE = re.compile(
    rb"global_step=(\d{1,15}), episodic_return=(\[)?\s*"
    rb"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,4})?)\s*(?(2)\])"
)


class CleanRLError(Exception):
    """CleanRL's script could not run to the end: missing, failed, timed out or unreadable."""


class MalformedOutput(CleanRLError):
    """A stdout line that says it is an episode's return but is not one, or too much output."""


@dataclass(frozen=True)
class Checkout:
    """Where CleanRL's source is (the folder holding `cleanrl/ppo.py`) and the interpreter with
    its dependencies (gymnasium 0.29, torch, tyro, tensorboard; mujoco for the MuJoCo rows)."""

    root: Path
    python: str

    def path(self, script: Path) -> Path:
        """`script` (`PPO` or `PPO_CONTINUOUS`) in this checkout."""
        return self.root / script


@dataclass(frozen=True)
class Episodes:
    """What a run's stdout said: how many episodes ended, the last one's step, and the returns of
    the last `WINDOW` of them, oldest first."""

    count: int
    last_step: int
    last: tuple[float, ...]

    @property
    def final_return(self) -> float:
        """The mean of the last `WINDOW` episodes' returns (NaN if none ended)."""
        return statistics.fmean(self.last) if self.last else math.nan


def ppo_argv(checkout: Checkout, script: Path, env_id: str, budget: int, seed: int) -> list[str]:
    """`script` on the CPU with its own defaults but for the env, the step budget and the seed
    (ppo.py runs `budget // 512` iterations of 4 envs × 128 steps, ppo_continuous_action.py
    `budget // 2048` of 1 env × 2048 steps)."""
    return [
        checkout.python, str(checkout.path(script)), "--env-id", env_id,
        "--total-timesteps", str(budget), "--seed", str(seed), "--no-cuda",
    ]  # fmt: skip


def parse_episodes(lines: Iterable[bytes]) -> Episodes:
    """The episodes in a script's stdout, one line per item (a trailing newline is allowed).

    Lines that do not start with `global_step=` (their `SPS: …` lines) are skipped; one that does
    must be `global_step=N, episodic_return=[R]` with N not below the line before's and R finite.
    Raises `MalformedOutput` for such a line that is not, a line over `MAX_LINE` bytes, or more
    than `MAX_LINES` lines."""
    count = 0
    last_step = 0
    returns: deque[float] = deque(maxlen=WINDOW)
    for number, raw in enumerate(lines, start=1):
        if number > MAX_LINES:
            raise MalformedOutput(f"more than {MAX_LINES:,} lines of output")
        line = raw[:-1] if raw.endswith(b"\n") else raw
        line = line[:-1] if line.endswith(b"\r") else line
        if len(line) > MAX_LINE:
            raise MalformedOutput(f"line {number} is longer than {MAX_LINE} bytes")
        if not line.startswith(b"global_step="):
            continue
        match = _EPISODE.fullmatch(line)
        if match is None:
            raise MalformedOutput(f"line {number} is not an episode's return: {_quote(line)}")
        step, value = int(match[1]), float(match[3])
        if not math.isfinite(value):
            raise MalformedOutput(f"line {number} has a return out of range: {_quote(line)}")
        if step < last_step:
            raise MalformedOutput(
                f"line {number} goes back from global_step={last_step}: {_quote(line)}"
            )
        count, last_step = count + 1, step
        returns.append(value)
    return Episodes(count, last_step, tuple(returns))


def train(
    checkout: Checkout,
    script: Path,
    env_id: str,
    budget: int,
    seed: int,
    *,
    cwd: Path,
    time_limit_s: float,
) -> tuple[Episodes, float]:
    """Runs `script` once in `cwd` and returns its episodes and wall seconds (start-up included).
    Raises `CleanRLError` if it cannot start, exits non-zero, runs past `time_limit_s` or prints
    malformed output (then it is killed)."""
    if not checkout.path(script).is_file():
        raise CleanRLError(f"no {script} under {checkout.root}: give a checkout of CleanRL")
    argv = ppo_argv(checkout, script, env_id, budget, seed)
    with tempfile.TemporaryFile() as stderr:
        started = time.perf_counter()
        try:
            proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr)
        except OSError as err:
            raise CleanRLError(f"cannot start {checkout.python}: {err}") from err
        timed_out = threading.Event()

        def stop() -> None:  # on the timer's thread
            timed_out.set()
            proc.kill()

        timer = threading.Timer(time_limit_s, stop)
        timer.start()
        stdout: IO[bytes] = proc.stdout  # type: ignore[assignment]  # stdout=PIPE: never None
        try:
            episodes = parse_episodes(iter(lambda: stdout.readline(MAX_LINE + 1), b""))
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            stdout.close()
        wall = time.perf_counter() - started
        if timed_out.is_set() and code != 0:
            raise CleanRLError(f"{env_id} seed {seed} ran past {time_limit_s:.0f} s")
        if code != 0:
            raise CleanRLError(f"{env_id} seed {seed} exited {code}: {_tail(stderr)}")
    return episodes, wall


def _quote(line: bytes) -> str:
    return repr(line[:80]) + ("…" if len(line) > 80 else "")


def _tail(stderr: IO[bytes]) -> str:
    """The last `STDERR_TAIL` bytes of `stderr`, from the start of a line."""
    start = max(0, stderr.seek(0, 2) - STDERR_TAIL)
    stderr.seek(start)
    tail = stderr.read()
    if start > 0 and b"\n" in tail[:-1]:
        tail = tail[tail.index(b"\n") + 1 :]
    return tail.decode("utf-8", errors="replace").strip()
