"""Structured observations packed into one flat array: random Dict/Tuple structures round-trip,
the packed dtype is the narrowest that holds every part, hostile structures and observations
are refused with the part and the limit, and MiniGrid's observation packs as expected."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.envs.packed_obs import (
    MAX_NESTING,
    MAX_PARTS,
    TEXT_BYTES,
    PackedBox,
    PackingError,
    PackObservation,
    layout,
    needs_packing,
    pack,
    unpack,
)

_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
_leaves = st.one_of(
    _shapes.map(lambda s: spaces.Box(0, 255, s, np.uint8)),
    _shapes.map(lambda s: spaces.Box(-10.0, 10.0, s, np.float32)),
    _shapes.map(lambda s: spaces.Box(-1000, 1000, s, np.int64)),
    st.builds(spaces.Discrete, st.integers(1, 300), start=st.integers(-5, 5)),
    st.lists(st.integers(1, 9), min_size=1, max_size=4).map(spaces.MultiDiscrete),
    st.integers(1, 5).map(spaces.MultiBinary),
    st.integers(1, 100).map(lambda n: spaces.Text(max_length=n)),
)


def _containers(children: st.SearchStrategy[spaces.Space[Any]]) -> st.SearchStrategy[Any]:
    keys = st.text("abcdefgh", min_size=1, max_size=6)
    return st.one_of(
        st.lists(children, min_size=1, max_size=4).map(spaces.Tuple),
        st.dictionaries(keys, children, min_size=1, max_size=4).map(spaces.Dict),
    )


# Three levels of recursion at most keep every structure within MAX_NESTING.
_structures = st.recursive(_leaves, _containers, max_leaves=12).filter(
    lambda s: _depth(s) <= MAX_NESTING
)


def _depth(space: spaces.Space[Any]) -> int:
    if isinstance(space, spaces.Dict):
        return 1 + max(_depth(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return 1 + max(_depth(s) for s in space)
    return 0


def _same(original: Any, back: Any, space: spaces.Space[Any]) -> None:
    if isinstance(space, spaces.Dict):
        assert list(back) == list(space.spaces)
        for key, sub in space.spaces.items():
            _same(original[key], back[key], sub)
    elif isinstance(space, spaces.Tuple):
        assert len(back) == len(space)
        for item, returned, sub in zip(original, back, space, strict=True):
            _same(item, returned, sub)
    elif isinstance(space, spaces.Text):
        assert back == original[: min(space.max_length, TEXT_BYTES)]
    else:
        assert np.array_equal(np.asarray(back), np.asarray(original))
        assert np.shape(back) == np.shape(original)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_structures, st.integers(0, 2**31 - 1))
def test_random_structures_round_trip_through_one_flat_array(
    structure: spaces.Space[Any], seed: int
) -> None:
    structure.seed(seed)
    observation = structure.sample()
    packed_space = PackedBox(structure)
    packed = pack(packed_space.layout, observation)
    assert packed.shape == packed_space.shape
    assert packed.dtype == packed_space.dtype
    assert packed_space.contains(packed)
    _same(observation, unpack(packed_space.layout, packed), structure)


@settings(max_examples=100, deadline=None)
@given(_structures)
def test_parts_tile_the_array_and_uint8_means_every_part_fits_a_byte(
    structure: spaces.Space[Any],
) -> None:
    lay = layout(structure)
    offset = 0
    for part in lay.parts:
        assert part.offset == offset
        offset += part.size
    assert offset == lay.size
    leaves = [p for p in lay.parts]
    fits = all(
        p.kind == "text"
        or (p.kind == "one-hot" and max(p.categories) <= 256)
        or p.dtype in ("uint8", "bool")
        for p in leaves
    )
    assert lay.dtype == ("uint8" if fits else "float32")


def test_minigrid_packs_into_340_bytes_with_its_mission() -> None:
    import minigrid  # noqa: F401  (registers the ids)

    env = PackObservation(gymnasium.make("MiniGrid-DoorKey-5x5-v0"))
    assert needs_packing(env.env.observation_space)
    space = env.observation_space
    assert isinstance(space, PackedBox)
    kinds = [(p.path, p.kind, p.size) for p in space.layout.parts]
    assert kinds == [
        (("direction",), "one-hot", 1),
        (("image",), "image", 147),
        (("mission",), "text", TEXT_BYTES),
    ]
    obs, _ = env.reset(seed=3)
    assert obs.dtype == np.uint8
    assert obs.shape == (340,)
    back = unpack(space.layout, obs)
    assert back["mission"] == "use the key to open the door and then get to the goal"
    assert np.array_equal(back["image"], env.unwrapped.gen_obs()["image"])
    env.close()


def test_text_is_truncated_and_nul_bytes_are_dropped() -> None:
    lay = layout(spaces.Text(max_length=200))
    assert lay.size == TEXT_BYTES
    assert unpack(lay, pack(lay, "x" * 300)) == "x" * TEXT_BYTES
    assert unpack(lay, pack(lay, "a\0b")) == "ab"
    assert unpack(lay, pack(lay, "née")) == "née"  # UTF-8 bytes, not the Text charset


def test_array_spaces_need_no_packing_and_the_rest_do() -> None:
    assert not needs_packing(spaces.Box(0, 1, (3,)))
    assert not needs_packing(spaces.MultiDiscrete([2, 3]))
    assert needs_packing(spaces.Discrete(4))
    assert needs_packing(spaces.Text(8))
    assert needs_packing(spaces.Dict({"a": spaces.Box(0, 1, (2,))}))


class _Opaque(spaces.Space[Any]):
    """A plugin's own space that cannot even sample."""


def _nested(levels: int) -> spaces.Space[Any]:
    space: spaces.Space[Any] = spaces.Discrete(2)
    for _ in range(levels):
        space = spaces.Tuple([space])
    return space


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        (
            spaces.Dict({f"k{i}": spaces.Discrete(2) for i in range(MAX_PARTS + 1)}),
            "more than 64 parts",
        ),
        (_nested(MAX_NESTING + 1), "nests deeper than 4 levels"),
        (spaces.Box(0, 1, (5000, 5000)), "each part needs 1 to 16777216 elements"),
        (spaces.Tuple([spaces.Box(0, 1, (4096, 4096))] * 2), "more than 16777216 elements"),
        (spaces.Discrete(1 << 17), "more than 65536 categories"),
        (spaces.Sequence(spaces.Discrete(3)), "is a Sequence, which cannot be packed"),
        (_Opaque(), "is a _Opaque, which cannot be packed"),
        (spaces.Dict({3: spaces.Discrete(2)}), "observation key '3' under"),
        (
            spaces.Dict(OrderedDict([("x" * 300, spaces.Discrete(2))])),
            "keys must be strings of at most 200 characters",
        ),
        (spaces.Dict({"a": spaces.Tuple([]), "b": spaces.Dict({})}), "holds no space to observe"),
    ],
)
def test_hostile_structures_are_refused_with_the_part_and_the_limit(
    structure: spaces.Space[Any], message: str
) -> None:
    with pytest.raises(PackingError, match=message):
        PackedBox(structure)


def test_an_observation_that_does_not_fit_its_space_is_refused() -> None:
    lay = layout(spaces.Dict({"pos": spaces.Box(0, 1, (2,)), "name": spaces.Text(8)}))
    with pytest.raises(PackingError, match="has no part pos"):
        pack(lay, {"name": "a"})
    with pytest.raises(PackingError, match="pos has 3 elements, its space says 2"):
        pack(lay, {"pos": [0, 0, 0], "name": "a"})
    with pytest.raises(PackingError, match="name must be a str, got int"):
        pack(lay, {"pos": [0, 0], "name": 5})
    with pytest.raises(PackingError, match="has 10 elements, got 3"):
        unpack(lay, np.zeros(3))


_READINGS = spaces.Dict(
    {"cells": spaces.Box(0, 255, (6,), np.uint8), "speed": spaces.Box(-5.0, 5.0, (2,), np.float32)}
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(-400, 400), min_size=6, max_size=6),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=2, max_size=2),
)
def test_an_observation_packs_exactly_or_is_refused_never_cast(
    cells: list[int], speed: list[float]
) -> None:
    lay = layout(_READINGS)
    observation = {"cells": np.array(cells, np.int64), "speed": np.array(speed, np.float32)}
    fits = all(0 <= c <= 255 for c in cells) and all(np.isfinite(speed))
    if not fits:
        with pytest.raises(PackingError, match=r"outside 0\.\.255|NaN or infinite"):
            pack(lay, observation)
        return
    back = unpack(lay, pack(lay, observation))
    assert back["cells"].tolist() == cells
    assert back["speed"].tolist() == np.array(speed, np.float32).tolist()


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 9), st.integers(-3, 3), st.integers(-20, 20))
def test_a_discrete_value_outside_its_space_is_refused(n: int, start: int, value: int) -> None:
    lay = layout(spaces.Tuple([spaces.Discrete(n, start=start)]))
    if start <= value < start + n:
        assert unpack(lay, pack(lay, (value,))) == (value,)
    else:
        with pytest.raises(PackingError, match="outside its Discrete"):
            pack(lay, (value,))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(-12, 12)), min_size=2, max_size=5))
def test_a_multidiscrete_value_outside_its_space_is_refused(
    cells: list[tuple[int, int]],
) -> None:
    nvec = [n for n, _ in cells]
    values = np.array([v for _, v in cells], dtype=np.int64)
    lay = layout(spaces.MultiDiscrete(nvec))
    if all(0 <= v < n for n, v in cells):
        assert unpack(lay, pack(lay, values)).tolist() == values.tolist()
    else:
        with pytest.raises(PackingError, match="outside its Discrete"):
            pack(lay, values)
