"""A shoal plugin environment whose observation is a Dict (grid, vector, text) is packed at the
vector boundary by the same packer as `gym:` ids, with no change to the plugin; hostile
observations from a plugin are a PackingError that names the part, never a crash or a silently
cast array."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

import shoal.envs as envs
from shoal.envs.gym_adapter import ShoalGymEnv
from shoal.envs.packed_obs import MAX_TEXT_CHARS, PackedBox, PackingError, PackObservation, unpack
from shoal.envs.vector import VectorRunner
from shoal.learner.models import ModelConfig, build_model
from shoal.learner.models.multi import MultiPolicy
from tests.support.signal_room import SIGNAL_ROOM, SignalRoom


def test_a_dict_observation_plugin_is_packed_at_the_vector_boundary() -> None:
    with envs.make_vector(SIGNAL_ROOM, 3, seed=5) as vec:
        space = vec.single_observation_space
        assert isinstance(space, PackedBox)
        assert space.structure == SignalRoom.observation_space
        assert space.dtype == np.float32  # the float vector makes the whole array float32
        obs = vec.reset()
        step = vec.step(np.zeros(3, dtype=np.int64))
        assert isinstance(build_model(ModelConfig(), space, vec.single_action_space), MultiPolicy)
    assert obs.shape == step.obs.shape == step.final_obs.shape == (3, space.shape[0])
    single = envs.make(SIGNAL_ROOM)
    single.seed(5)  # copy 0 of the vector is seeded with the vector's seed
    first, _ = single.reset()
    back = unpack(space.layout, obs[0])
    assert back["mission"] == first["mission"]
    assert np.array_equal(back["grid"], first["grid"])
    assert np.array_equal(back["vector"], first["vector"])
    assert space.contains(obs[0])


def test_the_vector_packs_exactly_as_the_gymnasium_path_does() -> None:
    env = SignalRoom()
    env.seed(3)
    first, _ = env.reset()
    wrapped = PackObservation(ShoalGymEnv(SignalRoom()))
    with envs.make_vector(SIGNAL_ROOM, 1, seed=3) as vec:
        assert vec.single_observation_space == wrapped.observation_space
        assert np.array_equal(vec.reset()[0], wrapped.observation(first))


class _Hostile(SignalRoom):
    """SignalRoom whose observation one test breaks by replacing a part."""

    part = "grid"
    value: Any = None

    def observe(self) -> dict[str, Any]:
        return {**super().observe(), self.part: self.value}


def _hostile(part: str, value: Any) -> Callable[[], SignalRoom]:
    return type("Broken", (_Hostile,), {"part": part, "value": value})


@pytest.mark.parametrize(
    ("part", "value", "message"),
    [
        ("grid", np.zeros((4, 4, 3), np.uint8), "grid has 48 elements, its space says 75"),
        ("grid", np.full((5, 5, 3), 0.5), "grid holds float64 values; its space says uint8"),
        (
            "grid",
            np.full((5, 5, 3), 300),
            "grid holds values outside 0..255, which its uint8 space",
        ),
        ("vector", np.array([0.0, np.nan, 0.0]), "vector holds NaN or infinite values"),
        ("vector", np.array(["a", "b", "c"]), "vector holds <U1 values"),
        ("mission", "go " * MAX_TEXT_CHARS, f"over {MAX_TEXT_CHARS}"),
        ("mission", 7, "mission must be a str, got int"),
    ],
)
def test_hostile_plugin_observations_are_a_packing_error_naming_the_part(
    part: str, value: Any, message: str
) -> None:
    with (
        VectorRunner(_hostile(part, value), 2, seed=0) as vec,
        pytest.raises(PackingError, match=message),
    ):
        vec.reset()


def test_a_plugin_space_that_cannot_be_packed_is_refused_and_its_copies_closed() -> None:
    closed: list[int] = []

    class Unpackable(SignalRoom):
        observation_space = spaces.Dict({"graph": spaces.Graph(spaces.Discrete(3), None)})

        def close(self) -> None:
            closed.append(1)

    with pytest.raises(PackingError, match="graph is a Graph, which cannot be packed"):
        VectorRunner(Unpackable, 3)
    assert closed == [1, 1, 1]
