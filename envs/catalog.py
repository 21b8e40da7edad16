"""Which environments really make, reset and step on this machine, and which of them train.

A registered id is only a promise: its package may be missing, its ROM absent, its native
library broken. `probe` tries each id in worker subprocesses (make, reset, a few random
steps, close) with a deadline per id; a worker that hangs or crashes is killed and replaced,
so one broken environment costs its own entry and nothing else. Stepping is not training: a
`check` (an import path, `module:function`, called with the id and returning why not, or "")
also asks whether the job trains it; this module knows nothing of training, so the caller
names the check (`shoal envs list` passes the learner's pre-flight). Results are cached in
`$SHOAL_HOME/envs/catalog.json` under a key of the installed versions, so `shoal envs list`
probes once per installation.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from shoal.envs.errors import EnvError
from shoal.files import write_atomically

PROBE_STEPS = 3
DEFAULT_TIMEOUT_S = 30.0
# Distributions whose versions decide which environments work (the cache key).
CATALOG_PACKAGES = (
    "shoal",
    "gymnasium",
    "numpy",
    "ale-py",
    "minigrid",
    "mujoco",
    "box2d",
    "pygame-ce",
)


@dataclass(frozen=True)
class ProbeResult:
    """One id's probe: `ok` when make, reset and steps all worked; `detail` says what failed."""

    id: str
    ok: bool
    detail: str
    seconds: float
    trains: bool | None = None
    """Whether the `check` passed (it runs only on an id that steps); None: not checked."""
    trains_detail: str = ""
    """Why it does not train, from the check."""


def probe_one(env_id: str, check: Callable[[str], str] | None = None) -> ProbeResult:
    """Make, reset and step one environment in this process (the worker's unit of work), then
    ask `check` whether it trains."""
    from shoal.envs.registry import make

    started = time.perf_counter()
    env = None
    try:
        env = make(env_id)
        env.seed(0)
        env.action_space.seed(0)
        env.reset()
        for _ in range(PROBE_STEPS):
            _, _, done, _ = env.step(env.action_space.sample())
            if done:
                env.reset()
        detail = "ok"
        ok = True
    except Exception as exc:  # a probe reports any failure of third-party code, it never raises
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        ok = False
    finally:
        if env is not None:
            try:
                env.close()
            except Exception as exc:
                if ok:
                    ok, detail = False, f"close failed: {type(exc).__name__}: {exc}"[:300]
    if not ok or check is None:
        return ProbeResult(env_id, ok, detail, time.perf_counter() - started)
    try:
        why_not = check(env_id)
    except Exception as exc:  # third-party wrappers and models: any failure means "does not train"
        why_not = f"{type(exc).__name__}: {exc}"
    why_not = why_not.splitlines()[0][:300] if why_not else ""
    return ProbeResult(env_id, ok, detail, time.perf_counter() - started, not why_not, why_not)


def _import_check(path: str) -> Callable[[str], str]:
    import importlib

    module, _, name = path.partition(":")
    check: Callable[[str], str] = getattr(importlib.import_module(module), name)
    return check


def _worker_main(imports: Sequence[str], check: str | None = None) -> None:
    """Read ids from stdin, answer one JSON line each on the original stdout.

    Environments print (ALE's banner, pygame's greeting): fd 1 is pointed at stderr so that
    nothing they write can corrupt the answers.
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import importlib

    import shoal.envs  # noqa: F401  (registers the built-ins)

    for module in imports:
        importlib.import_module(module)
    checker = None if check is None else _import_check(check)
    for line in sys.stdin:
        env_id = line.strip()
        if env_id:
            answers.write(json.dumps(asdict(probe_one(env_id, checker))) + "\n")


class _Worker:
    """One probing subprocess; replaced when it overruns a deadline or dies."""

    def __init__(
        self, imports: Sequence[str], env: dict[str, str] | None, check: str | None
    ) -> None:
        command = [sys.executable, "-m", "shoal.envs.catalog", "--worker"]
        for module in imports:
            command += ["--import", module]
        if check is not None:
            command += ["--check", check]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def ask(self, env_id: str, timeout: float) -> ProbeResult:
        started = time.perf_counter()
        stdin, stdout = self._pipes()
        try:
            stdin.write(env_id + "\n")
            stdin.flush()
        except OSError:
            return ProbeResult(env_id, False, "the probe worker died", 0.0)
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            self.kill()
            return ProbeResult(env_id, False, f"timed out after {timeout:g} s", timeout)
        line = stdout.readline()
        if not line:
            code = self.process.wait()
            self.kill()
            return ProbeResult(
                env_id,
                False,
                f"the probe process died (exit status {code})",
                time.perf_counter() - started,
            )
        return ProbeResult(**json.loads(line))

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None:
            raise EnvError("probe worker started without pipes")
        return stdin, stdout

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def close(self) -> None:
        if self.process.stdin is not None and self.alive:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def probe(
    env_ids: Sequence[str],
    *,
    workers: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    imports: Sequence[str] = (),
    env: dict[str, str] | None = None,
    check: str | None = None,
) -> list[ProbeResult]:
    """Probe every id in `workers` subprocesses; results in the order of `env_ids`.

    `imports` are modules each worker imports first (they may register more environments);
    `env` is the workers' environment (default: this process's); `check` is the
    `module:function` that says whether an id that steps also trains (see the module's text).
    """
    if workers < 1:
        raise EnvError(f"workers must be at least 1, got {workers}")
    if timeout <= 0:
        raise EnvError(f"timeout must be positive, got {timeout}")
    pending: queue.Queue[str] = queue.Queue()
    for env_id in env_ids:
        pending.put(env_id)
    results: dict[str, ProbeResult] = {}
    lock = threading.Lock()

    def slot() -> None:
        worker: _Worker | None = None
        try:
            while True:
                try:
                    env_id = pending.get_nowait()
                except queue.Empty:
                    return
                if worker is None or not worker.alive:
                    worker = _Worker(imports, env, check)
                result = worker.ask(env_id, timeout)
                with lock:
                    results[env_id] = result
        finally:
            if worker is not None:
                worker.close()

    threads = [
        threading.Thread(target=slot, daemon=True) for _ in range(min(workers, len(env_ids)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[env_id] for env_id in env_ids]


def installation_key() -> str:
    """What the probe results depend on: Python and the versions of the relevant packages."""
    from shoal.envs.hashing import package_version

    versions = {name: package_version(name) for name in CATALOG_PACKAGES}
    text = json.dumps({"python": platform.python_version(), "packages": versions}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def catalog_path() -> Path:
    from shoal.envs.hashing import shoal_home

    return shoal_home() / "envs" / "catalog.json"


def load_catalog(
    env_ids: Sequence[str],
    *,
    refresh: bool = False,
    workers: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: str | None = None,
) -> list[ProbeResult]:
    """Probe results for `env_ids`, from the cache where this installation probed them before
    (with `check`: an entry probed without one is probed again)."""
    path = catalog_path()
    key = installation_key()
    cached: dict[str, Any] = {}
    if not refresh and path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        if stored.get("key") == key:
            cached = stored.get("results", {})
    missing = [
        env_id
        for env_id in env_ids
        if env_id not in cached or (check is not None and _unchecked(cached[env_id]))
    ]
    if missing:
        for result in probe(missing, workers=workers, timeout=timeout, check=check):
            cached[result.id] = asdict(result)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps({"key": key, "results": cached}), durable=False)
        except OSError:
            pass  # the cache only saves time; a read-only SHOAL_HOME probes again next time
    return [ProbeResult(**cached[env_id]) for env_id in env_ids]


def _unchecked(entry: dict[str, Any]) -> bool:
    """A cached result that stepped but was never asked whether it trains."""
    return bool(entry.get("ok")) and entry.get("trains") is None


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        raise SystemExit(
            "usage: python -m shoal.envs.catalog --worker [--import MODULE]... [--check MOD:FUNC]"
        )
    arguments = sys.argv[2:]
    pairs = [(arguments[i], arguments[i + 1]) for i in range(0, len(arguments) - 1, 2)]
    checks = [value for flag, value in pairs if flag == "--check"]
    _worker_main(
        [value for flag, value in pairs if flag == "--import"], checks[-1] if checks else None
    )
