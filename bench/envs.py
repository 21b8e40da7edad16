"""`shoal bench envs`: environment steps per second and `make` rate beside Gymnasium's.

Every figure is measured in this run: shoal's batched CartPole beside Gymnasium's CartPole-v1
as one env, in SyncVectorEnv and AsyncVectorEnv, Gymnasium's own numpy CartPoleVectorEnv and
EnvPool when it is importable. Actions are drawn before the clock starts, so the figures
measure stepping only. Each loop runs for a fixed wall time and counts steps.

With ale-py installed, Pong is measured through a real rollout collector (environment, policy
and fragment buffer) at the same environment count both ways: the `atari` wrapper set's uint8
[4, 84, 84] frames with the CNN `auto` picks, against raw frames stored as float32 for an MLP
(the path before the wrapper set), and the bytes of one fragment each way; and the vector
alone (the set emulates every frame to max-pool the last two, so it steps slower than the
emulator's own frame skip: the gain is in what the frames cost afterwards).
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


def _interleaved(runs: list[Callable[[], int]], seconds: float) -> list[float]:
    """Steps/s of each run, called in turn until `seconds` have passed: a shared machine's load
    then weighs on every run alike, where one run after the other would each see another."""
    steps, spent = [0] * len(runs), [0.0] * len(runs)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for i, run in enumerate(runs):
            started = time.perf_counter()
            steps[i] += run()
            spent[i] += time.perf_counter() - started
    return [n / t for n, t in zip(steps, spent, strict=True)]


def _pong_rows(seconds: float, horizon: int) -> list[Row]:
    try:
        import ale_py  # noqa: F401
    except ImportError:
        return []
    import torch

    from shoal.envs.vector import make_vector
    from shoal.envs.wrappers import EnvConfig
    from shoal.learner.collector import Collector
    from shoal.learner.models import ModelConfig, build_model

    torch.set_num_threads(1)
    atari = EnvConfig(wrappers=({"name": "atari", "kwargs": {}},))
    framed_vec = make_vector("gym:ALE/Pong-v5", PONG_ENVS, seed=0, env=atari)
    raw_vec = make_vector("gym:ALE/Pong-v5", PONG_ENVS, seed=0)
    actions = np.random.default_rng(0).integers(0, 6, (8, PONG_ENVS))

    def stepper(vector: Any, dtype: type) -> Callable[[], int]:
        # Observations converted as a policy's buffer stores them: uint8 stays, raw frames
        # become float32 (an MLP's input).
        def run() -> int:
            for row in actions:
                vector.step(row).obs.astype(dtype, copy=False)
            return len(actions) * PONG_ENVS

        return run

    def collector(vector: Any, family: str) -> Collector:
        model = build_model(
            ModelConfig(family=family), vector.single_observation_space, vector.single_action_space
        )
        return Collector("bench", vector, model, horizon, "bench", seed=0)

    try:
        for vector in (framed_vec, raw_vec):
            vector.reset()
        framed_env, raw_env = _interleaved(
            [stepper(framed_vec, np.uint8), stepper(raw_vec, np.float32)], seconds
        )
        framed_col, raw_col = collector(framed_vec, "auto"), collector(raw_vec, "mlp")
        framed_bytes, raw_bytes = (c.collect().obs.nbytes for c in (framed_col, raw_col))
        framed, raw = _interleaved(
            [lambda: framed_col.collect().num_steps, lambda: raw_col.collect().num_steps], seconds
        )
    finally:
        framed_vec.close()
        raw_vec.close()
    baseline = "raw frames as float32 + MLP"
    shape = f"{horizon} steps x {PONG_ENVS} envs"
    return [
        Row(f"Pong env steps/s, vector x{PONG_ENVS}: atari set uint8", "steps/s",
            framed_env, raw_env, "raw frames as float32", True),
        Row(f"Pong env steps/s, collector x{PONG_ENVS}: atari set uint8 + CNN", "steps/s",
            framed, raw, baseline, True),
        Row(f"Pong fragment observations, {shape}: atari set uint8", "bytes",
            framed_bytes, raw_bytes, baseline, False),
    ]  # fmt: skip


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
