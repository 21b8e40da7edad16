"""The evaluation's observation-noise sweep on integer observations: noise is scaled to the
space's range and saturates at the dtype's bounds (pixels never wrap from 255 to 0); float
observations take σ in their own units, as before."""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal.envs.evaluation import EvalOptions, evaluate, perturb

PIXELS = spaces.Box(0, 255, (2, 3, 3), np.uint8)


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(np.uint8, (4, 2, 3, 3)),
    st.floats(0.0, 3.0),
    st.integers(0, 2**32 - 1),
)
def test_a_perturbed_uint8_observation_is_the_clipped_float_sum(
    obs: np.ndarray, sigma: float, seed: int
) -> None:
    seen = perturb(obs, sigma, PIXELS, np.random.default_rng(seed))
    noise = np.random.default_rng(seed).normal(0.0, sigma, size=obs.shape) * 255.0
    assert seen.dtype == np.uint8
    assert seen.shape == obs.shape
    assert int(seen.min()) >= 0
    assert int(seen.max()) <= 255
    expected = np.clip(np.rint(obs.astype(np.float64) + noise), 0, 255)
    assert np.array_equal(seen.astype(np.float64), expected)


def test_bright_pixels_saturate_instead_of_wrapping() -> None:
    obs = np.full((1, 2, 3, 3), 250, np.uint8)
    seen = perturb(obs, 0.5, PIXELS, np.random.default_rng(0))
    above = np.random.default_rng(0).normal(0.0, 0.5, size=obs.shape) > 5 / 255
    assert above.any()
    assert (seen[above] == 255).all()  # 250 + more than 5 levels: 255, not a dark pixel


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.int8, (3, 4), elements=st.integers(-5, 5)), st.floats(0.0, 40.0))
def test_integer_noise_is_scaled_to_the_space_and_clipped_to_the_dtype(
    obs: np.ndarray, sigma: float
) -> None:
    space = spaces.Box(-5, 5, (4,), np.int8)
    seen = perturb(obs, sigma, space, np.random.default_rng(1))
    noise = np.random.default_rng(1).normal(0.0, sigma, size=obs.shape) * 10.0
    assert seen.dtype == np.int8
    expected = np.clip(np.rint(obs + noise), -128, 127)
    assert np.array_equal(seen.astype(np.float64), expected)


def test_float_observations_take_sigma_in_their_own_units() -> None:
    obs = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)
    space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    seen = perturb(obs, 0.1, space, np.random.default_rng(2))
    noise = np.random.default_rng(2).normal(0.0, 0.1, size=obs.shape).astype(np.float32)
    assert seen.dtype == np.float32
    assert np.array_equal(seen, obs + noise)


def test_the_sweep_on_packed_uint8_observations_stays_in_bytes() -> None:
    label = [""]
    seen: dict[str, list[np.ndarray]] = {}

    def forward(obs: np.ndarray) -> np.ndarray:
        seen.setdefault(label[0], []).append(obs)
        return np.full(obs.shape[0], 2, dtype=np.int64)  # MiniGrid's "forward"

    def progress(condition: str, done: int, total: int) -> None:
        label[0] = condition

    options = EvalOptions(episodes=2, num_envs=2, obs_noise=(0.0, 0.3), action_noise=(0.0,))
    result = evaluate(
        forward, "gym:MiniGrid-Empty-5x5-v0", episodes=2, options=options, progress=progress
    )
    assert [point.level for point in result.obs_noise] == [0.0, 0.3]
    clean, noisy = seen["no noise"][0], seen["obs noise σ=0.3"][0]
    assert clean.dtype == noisy.dtype == np.uint8
    assert noisy.shape == clean.shape
    assert not np.array_equal(noisy, clean)  # the same first observation, with noise
