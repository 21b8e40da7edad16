"""`shoal train` in a child process, as the end-to-end training tests run it: the real CLI and a
real cluster, one torch thread per process (the machine is small and shared), and a timeout
below the test's own so that a hung run fails with its output rather than pytest's traceback.

`run_train` is for runs judged by their `--json` summary; `train_process` for those judged by
their exit status and stderr (a refusal, a run that ends with a reason)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

STDERR_TAIL = 2000
"""How much of a failed run's stderr the assertion quotes: its traceback or last error line."""


def train_process(
    target: str,
    *flags: str,
    run_dir: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m shoal train target *flags --run-dir run_dir`, finished: its status and text
    output. `env` adds to (or overrides) this process's environment, OMP_NUM_THREADS=1 under it."""
    argv = [sys.executable, "-m", "shoal", "train", target, *flags, "--run-dir", str(run_dir)]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        argv, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )


def run_train(
    target: str,
    *flags: str,
    run_dir: Path,
    timeout: float,
    codes: Collection[int] = (0,),
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """The summary (the last stdout line of `--json`, which this adds) of a `train_process`
    run that exited with one of `codes`; any other status fails, quoting stderr's tail."""
    out = train_process(
        target, *flags, "--json", run_dir=run_dir, timeout=timeout, env=env, cwd=cwd
    )
    assert out.returncode in codes, out.stderr[-STDERR_TAIL:]
    summary: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return summary
