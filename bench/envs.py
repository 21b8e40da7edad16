"""`shoal bench envs`: environment steps per second and `make` rate beside Gymnasium's.

Every figure is measured in this run: shoal's batched CartPole beside Gymnasium's CartPole-v1
as one env, in SyncVectorEnv and AsyncVectorEnv, Gymnasium's own numpy CartPoleVectorEnv and
EnvPool when it is importable. Actions are drawn before the clock starts, so the figures
measure stepping only. Each loop runs for a fixed wall time and counts steps.

With ale-py installed, Pong is measured three ways at the same environment count, interleaved:
the `atari` set run by ale-py's C++ vector as one vector, the same set per copy in numpy
(`VectorRunner`, what any other wrapper list gets), and raw frames stored as float32 (the path
before the set). Each is timed as the vector alone and through a real rollout collector
(environment, policy and fragment buffer: the CNN `auto` picks for the uint8 [4, 84, 84]
frames, an MLP for the raw ones), with the bytes of one fragment. A fourth collector runs the
C++ vector as `make_vector` makes it, two halves the collector pipelines (one half's
emulators step while the CNN acts on the other: learner/collector.py), in the same turns.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np

from shoal.bench.report import Row
from shoal.envs import make, make_vector

BATCH = 4096
SMALL_BATCH = 16
PONG_ENVS = 8
PONG = "gym:ALE/Pong-v5"


def _rate(step_batch: Callable[[np.ndarray], Any], actions: np.ndarray, seconds: float) -> float:
    """Environment steps per second of calling `step_batch` on pregenerated action rows."""
    per_call = actions.shape[1] if actions.ndim == 2 else 1
    step_batch(actions[0])
    calls = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for row in actions:
            step_batch(row)
        calls += len(actions)
        now = time.perf_counter()
        if now >= deadline:
            return calls * per_call / (now - started)


def _actions(rows: int, batch: int | None, seed: int = 0) -> np.ndarray:
    shape = (rows,) if batch is None else (rows, batch)
    return np.random.default_rng(seed).integers(0, 2, size=shape)


def _shoal_batched(seconds: float) -> float:
    vector = make_vector("CartPole-v1", BATCH, seed=0)
    vector.reset()
    return _rate(vector.step, _actions(64, BATCH), seconds)


def _gym_single(seconds: float) -> float:
    env = gymnasium.make("CartPole-v1")
    env.reset(seed=0)

    def step(action: np.ndarray) -> None:
        _, _, terminated, truncated, _ = env.step(int(action))
        if terminated or truncated:
            env.reset()

    try:
        return _rate(step, _actions(4096, None), seconds)
    finally:
        env.close()


def _gym_vector(mode: str, num_envs: int, seconds: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vector = gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode=mode)
    try:
        vector.reset(seed=0)
        return _rate(vector.step, _actions(64, num_envs), seconds)
    finally:
        vector.close()


def _envpool(seconds: float) -> float | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import envpool
        except ImportError:
            return None
        pool = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=BATCH, batch_size=BATCH)
        pool.reset()  # envpool builds its float64-bounded spaces here, which Gymnasium warns about
    try:
        return _rate(pool.step, _actions(64, BATCH), seconds)
    finally:
        pool.close()


def _interleaved(runs: list[Callable[[], int]], seconds: float) -> list[tuple[float, float]]:
    """(steps/s, CPU seconds per step) of each run, called in turn until `seconds` have passed:
    a shared machine's load then weighs on every run alike, where one run after the other would
    each see another. The CPU time is the whole process's (emulator threads included; the other
    runs are idle meanwhile): on a loaded machine, where a process gets a share of the cores
    rather than idle ones to overlap into, it is what the steps/s follow."""
    steps, spent, cpu = [0] * len(runs), [0.0] * len(runs), [0.0] * len(runs)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for i, run in enumerate(runs):
            started, cpu_started = time.perf_counter(), time.process_time()
            steps[i] += run()
            spent[i] += time.perf_counter() - started
            cpu[i] += time.process_time() - cpu_started
    return [(n / t, c / n) for n, t, c in zip(steps, spent, cpu, strict=True)]


def _pong_rows(seconds: float, horizon: int) -> list[Row]:
    try:
        import ale_py  # noqa: F401
    except ImportError:
        return []
    import torch

    from shoal.envs.ale_vector import AleVector
    from shoal.envs.atari import AtariOptions
    from shoal.envs.vector import VectorRunner
    from shoal.envs.wrappers import EnvConfig, make_wrapped

    torch.set_num_threads(1)
    atari = EnvConfig(wrappers=({"name": "atari", "kwargs": {}},))
    gym_id = PONG.removeprefix("gym:")
    vectors = {
        "native": AleVector(gym_id, PONG_ENVS, AtariOptions(), {}, seed=0, groups=1),
        "per-copy": VectorRunner(lambda: make_wrapped(PONG, atari, {}), PONG_ENVS, seed=0),
        "raw": make_vector(PONG, PONG_ENVS, seed=0),
        "pipelined": make_vector(PONG, PONG_ENVS, seed=0, env=atari),
        "pipelined-bf16": make_vector(PONG, PONG_ENVS, seed=0, env=atari),
    }
    try:
        return _pong_measured(vectors, seconds, horizon)
    finally:
        for vector in vectors.values():
            vector.close()


def _pong_measured(vectors: dict[str, Any], seconds: float, horizon: int) -> list[Row]:
    """The three Pong paths interleaved as vectors alone, then the five as real collectors
    (the pipelined C++ vector's halves step as one vector in `step`, so it has no vector row;
    the fifth is the same with the CNN sampling in bfloat16, `rollout.precision`)."""
    from shoal.learner.collector import Collector
    from shoal.learner.models import ModelConfig, build_model

    actions = np.random.default_rng(0).integers(0, 6, (8, PONG_ENVS))
    dtypes = {"native": np.uint8, "per-copy": np.uint8, "raw": np.float32}

    def stepper(name: str) -> Callable[[], int]:
        # Observations converted as a policy's buffer stores them: uint8 stays, raw frames
        # become float32 (an MLP's input).
        def run() -> int:
            for row in actions:
                vectors[name].step(row).obs.astype(dtypes[name], copy=False)
            return len(actions) * PONG_ENVS

        return run

    def collector(name: str) -> Collector:
        vector = vectors[name]
        family = "mlp" if name == "raw" else "auto"
        model = build_model(
            ModelConfig(family=family), vector.single_observation_space, vector.single_action_space
        )
        if name.endswith("-bf16"):
            model.run_in("bfloat16")
        pipeline = name.startswith("pipelined")
        return Collector("bench", vector, model, horizon, "bench", seed=0, pipeline=pipeline)

    alone = ("native", "per-copy", "raw")
    for vector in vectors.values():
        vector.reset()
    turns = _interleaved([stepper(name) for name in alone], seconds)
    env = {name: rate for name, (rate, _) in zip(alone, turns, strict=True)}
    collectors = {name: collector(name) for name in vectors}
    nbytes = {name: c.collect().obs.nbytes for name, c in collectors.items()}
    turns = _interleaved([_collect_steps(c) for c in collectors.values()], seconds)
    col = {name: rate for name, (rate, _) in zip(vectors, turns, strict=True)}
    per_cpu = {name: 1.0 / per_step for name, (_, per_step) in zip(vectors, turns, strict=True)}
    raw, raw_mlp = "raw frames as float32", "raw frames as float32 + MLP"
    native, per_copy = "atari set, ale-py C++ vector", "atari set per copy (numpy)"
    halves = "atari set, C++ vector halves pipelined"
    x = f"x{PONG_ENVS}"
    return [
        Row(f"Pong env steps/s, vector {x}: {native}", "steps/s", env["native"], env["raw"], raw, True),
        Row(f"Pong env steps/s, vector {x}: {per_copy}", "steps/s", env["per-copy"], env["raw"], raw, True),
        Row(f"Pong env steps/s, vector {x}: {native}", "steps/s", env["native"], env["per-copy"], per_copy, True),
        Row(f"Pong env steps/s, collector {x}: {native} + CNN", "steps/s", col["native"], col["raw"], raw_mlp, True),
        Row(f"Pong env steps/s, collector {x}: {per_copy} + CNN", "steps/s", col["per-copy"], col["raw"], raw_mlp, True),
        Row(f"Pong env steps/s, collector {x}: {native} + CNN", "steps/s", col["native"], col["per-copy"], f"{per_copy} + CNN", True),
        Row(f"Pong env steps/s, collector {x}: {halves} + CNN", "steps/s", col["pipelined"], col["raw"], raw_mlp, True),
        Row(f"Pong env steps/s, collector {x}: {halves} + CNN", "steps/s", col["pipelined"], col["native"], f"{native} + CNN", True),
        Row(f"Pong env steps/s, collector {x}: {halves} + CNN in bfloat16", "steps/s", col["pipelined-bf16"], col["raw"], raw_mlp, True),
        Row(f"Pong env steps/s, collector {x}: {halves} + CNN in bfloat16", "steps/s", col["pipelined-bf16"], col["pipelined"], f"{halves} + CNN", True),
        Row(f"Pong env steps per CPU second, collector {x}: {native} + CNN", "steps/CPU s", per_cpu["native"], per_cpu["raw"], raw_mlp, True),
        Row(f"Pong env steps per CPU second, collector {x}: {halves} + CNN", "steps/CPU s", per_cpu["pipelined"], per_cpu["raw"], raw_mlp, True),
        Row(f"Pong env steps per CPU second, collector {x}: {halves} + CNN", "steps/CPU s", per_cpu["pipelined"], per_cpu["native"], f"{native} + CNN", True),
        Row(f"Pong env steps per CPU second, collector {x}: {halves} + CNN in bfloat16", "steps/CPU s", per_cpu["pipelined-bf16"], per_cpu["pipelined"], f"{halves} + CNN", True),
        Row(f"Pong fragment observations, {horizon} steps {x}: uint8", "bytes", nbytes["native"], nbytes["raw"], raw_mlp, False),
    ]  # fmt: skip


def _collect_steps(collector: Any) -> Callable[[], int]:
    return lambda: int(collector.collect().num_steps)


def _make_rate(factory: Callable[[], Any], seconds: float) -> float:
    factory()
    count = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(100):
            factory()
        count += 100
    return count / elapsed


def run(quick: bool) -> list[Row]:
    seconds = 0.2 if quick else 2.0
    shoal = _shoal_batched(seconds)
    name = f"shoal CartPole-v1, native batch of {BATCH}"
    baselines: list[tuple[str, float | None]] = [
        ("gymnasium CartPole-v1, one env", _gym_single(seconds)),
        (f"gymnasium SyncVectorEnv x{SMALL_BATCH}", _gym_vector("sync", SMALL_BATCH, seconds)),
        (f"gymnasium AsyncVectorEnv x{SMALL_BATCH}", _gym_vector("async", SMALL_BATCH, seconds)),
        (
            f"gymnasium CartPoleVectorEnv x{BATCH}",
            _gym_vector("vector_entry_point", BATCH, seconds),
        ),
        (f"envpool x{BATCH}", _envpool(seconds)),
    ]
    rows = [
        Row(f"env steps/s: {name}", "steps/s", shoal, rate, baseline, True)
        for baseline, rate in baselines
        if rate is not None
    ]
    rows.append(
        Row(
            "make('CartPole-v1') rate",
            "makes/s",
            _make_rate(lambda: make("CartPole-v1"), seconds),
            _make_rate(lambda: gymnasium.make("CartPole-v1"), seconds),
            "gymnasium.make('CartPole-v1')",
            True,
        )
    )
    return rows + _pong_rows(seconds * 10, 4 if quick else 32)
