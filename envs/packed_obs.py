"""Structured observations (Dict, Tuple, Text, Discrete) packed into one flat array.

Rollouts, fragments and the transport move one array per step; MiniGrid and BabyAI observe a
Dict of an image, a direction and a mission string. `PackObservation` flattens such an
observation into a `PackedBox` that keeps the original space as `.structure`, so a model (the
`multi` family) can cut the array back into its parts with `layout(structure)`: each part's
offset, shape, source dtype and kind (image, vector, one-hot or text).

The array is uint8 when every part fits in a byte (uint8 and bool Boxes, Discretes of at most
256 categories, text), else float32 (float parts are stored as float32; integers are exact up
to 2**24). Discrete values are stored from 0 (their `start` subtracted). Text becomes
`TEXT_BYTES` byte ids of its UTF-8 encoding, 0-padded: longer text is truncated, NUL bytes are
dropped (0 is the padding). The structure may come from a plugin or a checkpoint, so it is
bounded: at most `MAX_PARTS` leaves, `MAX_NESTING` levels and `MAX_PACKED` elements. So is each
observation, which a plugin returns unchecked: a part of the wrong size, non-numbers, NaN or
infinity, floats for an integer part, integers outside the part's dtype, a Discrete out of range or
text over `MAX_TEXT_CHARS` characters is a `PackingError`, never a silently cast array.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from shoal.envs.errors import EnvError

TEXT_BYTES = 192
"""Byte ids per text part (a mission); `Text(max_length=n)` with n < 192 takes n. BabyAI's
longest missions (BossLevel, SynthSeq) run to about 170 bytes."""
MAX_PARTS = 64
MAX_NESTING = 4
MAX_PACKED = 1 << 24
"""Most elements in one packed observation (a 2048×2048×4 image)."""
MAX_TEXT_CHARS = 4096
"""Longest text an observation may hold; longer text is an environment bug (or hostile), not
a mission, and is refused before it is encoded."""
MAX_CATEGORIES = 1 << 16
"""Most categories of one Discrete element (each becomes a one-hot of this width)."""

KINDS = ("image", "vector", "one-hot", "text")
_BYTE_DTYPES = ("uint8", "bool")


class PackingError(EnvError):
    """An observation space cannot be packed (unsupported, too large, too deep), or an
    observation does not fit its space; the message names the part and the limit."""


@dataclass(frozen=True)
class Part:
    """One leaf of the structure and where it lives in the packed array."""

    path: tuple[str | int, ...]
    """Keys (Dict) and indices (Tuple) from the root to this leaf; () for a bare leaf."""
    kind: str
    offset: int
    shape: tuple[int, ...]
    """image: [H, W, C] or [C, H, W]; vector: the Box's shape; one-hot: () for a Discrete, the
    nvec shape for a MultiDiscrete; text: [bytes]."""
    dtype: str
    """The leaf's own dtype ("uint8", "float32", "int64", "bool"); "text" for text."""
    categories: tuple[int, ...] = ()
    """one-hot: the number of categories of each element."""
    starts: tuple[int, ...] = ()
    """one-hot: each element's lowest value (subtracted when packing)."""

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def leaf_dtype(self) -> np.dtype[Any]:
        """`dtype` as a numpy dtype (not for text), made once: each observation is compared."""
        return np.dtype(self.dtype)

    @functools.cached_property
    def start_array(self) -> np.ndarray:
        """`starts` as int64, made once: each packed observation subtracts it."""
        return np.array(self.starts, dtype=np.int64)

    @functools.cached_property
    def category_array(self) -> np.ndarray:
        """`categories` as int64, made once: each packed observation is checked against it."""
        return np.array(self.categories, dtype=np.int64)


@dataclass(frozen=True)
class Layout:
    """Every part in packing order, the packed length and the packed dtype."""

    parts: tuple[Part, ...]
    size: int
    dtype: str


def needs_packing(space: spaces.Space[Any]) -> bool:
    """Whether a vector of this observation space needs `PackObservation` (not a numeric array)."""
    return not isinstance(space, spaces.Box | spaces.MultiDiscrete | spaces.MultiBinary)


def layout(structure: spaces.Space[Any]) -> Layout:
    """Where each leaf of `structure` goes (pure: no observation needed); PackingError if it
    holds an unsupported space or is larger or deeper than the limits."""
    parts: list[Part] = []
    _walk(structure, (), parts)
    if not parts:
        raise PackingError(f"the observation space {structure} holds no space to observe")
    size = sum(part.size for part in parts)
    fits_byte = all(_fits_byte(part) for part in parts)
    return Layout(tuple(parts), size, "uint8" if fits_byte else "float32")


def pack(lay: Layout, observation: Any) -> np.ndarray:
    """One observation of the structure `lay` was made from, as a flat array of `lay.dtype`."""
    out = np.zeros(lay.size, dtype=lay.dtype)
    for part in lay.parts:
        value = _lookup(observation, part.path)
        out[part.offset : part.offset + part.size] = _encode(part, value)
    return out


def unpack(lay: Layout, packed: np.ndarray) -> Any:
    """The nested observation back from one packed array (for custom models and tests): Dicts
    as dicts, Tuples as tuples, Boxes in their own dtype, Discretes as ints, text as str."""
    flat = np.asarray(packed).reshape(-1)
    if flat.size != lay.size:
        raise PackingError(f"a packed observation has {lay.size} elements, got {flat.size}")
    root: dict[Any, Any] = {}
    for part in lay.parts:
        _store(
            root, ("root", *part.path), _decode(part, flat[part.offset : part.offset + part.size])
        )
    return _freeze(root["root"])


class PackedBox(spaces.Box):
    """A flat Box of packed observations that remembers the space it packs (`structure`)."""

    def __init__(self, structure: spaces.Space[Any], seed: int | None = None) -> None:
        self.structure = structure
        self.layout = layout(structure)
        dtype = np.dtype(self.layout.dtype)
        low = np.zeros(self.layout.size, dtype=np.float64)
        high = np.zeros(self.layout.size, dtype=np.float64)
        for part, leaf in zip(self.layout.parts, _leaves(structure), strict=True):
            (
                low[part.offset : part.offset + part.size],
                high[part.offset : part.offset + part.size],
            ) = _bounds(part, leaf, dtype)
        super().__init__(low.astype(dtype), high.astype(dtype), (self.layout.size,), dtype, seed)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PackedBox) and self.layout == other.layout and super().__eq__(other)
        )

    def __repr__(self) -> str:
        return f"PackedBox({self.structure}, {self.layout.size} {self.layout.dtype})"


class PackObservation(gymnasium.ObservationWrapper[np.ndarray, Any, Any]):
    """Packs each observation of a structured environment into its `PackedBox`."""

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self.observation_space = PackedBox(env.observation_space)
        self._layout = self.observation_space.layout

    def observation(self, observation: Any) -> np.ndarray:
        return pack(self._layout, observation)


# -- the walk over the structure -----------------------------------------------------------


def _walk(space: spaces.Space[Any], path: tuple[str | int, ...], parts: list[Part]) -> None:
    if isinstance(space, spaces.Dict | spaces.Tuple):
        if len(path) >= MAX_NESTING:
            raise PackingError(
                f"observation part {_name(path)} nests deeper than {MAX_NESTING} levels of "
                "Dict/Tuple: flatten it in a wrapper first"
            )
        items: Sequence[tuple[str | int, spaces.Space[Any]]] = (
            list(space.spaces.items()) if isinstance(space, spaces.Dict) else list(enumerate(space))
        )
        for key, sub in items:
            if isinstance(space, spaces.Dict) and (not isinstance(key, str) or len(key) > 200):
                raise PackingError(
                    f"observation key {str(key)[:40]!r} under {_name(path)}: keys must be strings "
                    "of at most 200 characters"
                )
            _walk(sub, (*path, key), parts)
        return
    if len(parts) >= MAX_PARTS:
        raise PackingError(
            f"the observation has more than {MAX_PARTS} parts: combine some in a wrapper first"
        )
    offset = parts[-1].offset + parts[-1].size if parts else 0
    part = _leaf(space, path, offset)
    if offset + part.size > MAX_PACKED:
        raise PackingError(
            f"the observation packs into more than {MAX_PACKED} elements (at part {_name(path)}): "
            "downsample images with a wrapper (e.g. ResizeObservation) first"
        )
    parts.append(part)


def _leaf(space: spaces.Space[Any], path: tuple[str | int, ...], offset: int) -> Part:
    if isinstance(space, spaces.Box):
        assert space.dtype is not None  # gymnasium allows only integer, float and bool Boxes
        shape = tuple(int(d) for d in space.shape)
        _check_elements(path, shape)
        kind = "image" if len(shape) == 3 else "vector"
        return Part(path, kind, offset, shape, space.dtype.name)
    if isinstance(space, spaces.MultiBinary):
        shape = tuple(int(d) for d in np.atleast_1d(space.n))
        _check_elements(path, shape)
        return Part(path, "vector", offset, shape, "bool")
    if isinstance(space, spaces.Discrete):
        return _one_hot(path, offset, (), [int(space.n)], [int(space.start)])
    if isinstance(space, spaces.MultiDiscrete):
        nvec, starts = space.nvec.reshape(-1).tolist(), space.start.reshape(-1).tolist()
        return _one_hot(path, offset, space.nvec.shape, nvec, starts)
    if _is_text(space):
        length = (
            min(int(space.max_length), TEXT_BYTES) if isinstance(space, spaces.Text) else TEXT_BYTES
        )
        return Part(path, "text", offset, (max(length, 1),), "text")
    raise PackingError(
        f"observation part {_name(path)} is a {type(space).__name__}, which cannot be packed: "
        "supported are Box, Discrete, MultiDiscrete, MultiBinary, Text, Dict and Tuple"
    )


def _one_hot(
    path: tuple[str | int, ...],
    offset: int,
    shape: tuple[int, ...],
    nvec: list[int],
    starts: list[int],
) -> Part:
    _check_elements(path, shape)
    if any(not 1 <= n <= MAX_CATEGORIES for n in nvec):
        raise PackingError(
            f"observation part {_name(path)} has a Discrete of more than {MAX_CATEGORIES} "
            "categories, too many for a one-hot: observe it as a Box instead"
        )
    return Part(path, "one-hot", offset, tuple(shape), "int64", tuple(nvec), tuple(starts))


def _is_text(space: spaces.Space[Any]) -> bool:
    """Text, or a space whose samples are strings (MiniGrid's MissionSpace is not a Text)."""
    if isinstance(space, spaces.Text):
        return True
    if type(space).__module__.startswith("gymnasium."):
        return False
    try:
        return isinstance(space.sample(), str)
    except NotImplementedError:  # a Space subclass that cannot sample: not text we can tell
        return False


def _check_elements(path: tuple[str | int, ...], shape: tuple[int, ...]) -> None:
    if any(d < 1 for d in shape) or len(shape) > 8 or math.prod(shape) > MAX_PACKED:
        raise PackingError(
            f"observation part {_name(path)} has shape {list(shape)}: each part needs 1 to "
            f"{MAX_PACKED} elements"
        )


def _fits_byte(part: Part) -> bool:
    if part.kind == "one-hot":
        return all(n <= 256 for n in part.categories)
    return part.kind == "text" or part.dtype in _BYTE_DTYPES


def _leaves(space: spaces.Space[Any]) -> list[spaces.Space[Any]]:
    if isinstance(space, spaces.Dict):
        return [leaf for sub in space.spaces.values() for leaf in _leaves(sub)]
    if isinstance(space, spaces.Tuple):
        return [leaf for sub in space for leaf in _leaves(sub)]
    return [space]


def _bounds(part: Part, leaf: spaces.Space[Any], dtype: np.dtype[Any]) -> tuple[Any, Any]:
    if isinstance(leaf, spaces.Box):
        low, high = (
            leaf.low.reshape(-1).astype(np.float64),
            leaf.high.reshape(-1).astype(np.float64),
        )
        if dtype.kind != "f":
            return np.clip(low, 0, 255), np.clip(high, 0, 255)
        return _as_float32(low), _as_float32(high)
    if part.kind == "one-hot":
        return 0.0, np.array(part.categories, dtype=np.float64) - 1
    return 0.0, 1.0 if part.dtype == "bool" else 255.0


def _as_float32(bounds: np.ndarray) -> np.ndarray:
    """Limits beyond float32's range become its largest value; infinities stay infinite."""
    top = float(np.finfo(np.float32).max)
    return np.where(np.isinf(bounds), bounds, np.clip(bounds, -top, top))


# -- one observation in and out ------------------------------------------------------------


def _lookup(observation: Any, path: tuple[str | int, ...]) -> Any:
    value = observation
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise PackingError(
                f"the observation has no part {_name(path)}: does the environment return what "
                "its observation_space says?"
            ) from exc
    return value


def _encode(part: Part, value: Any) -> np.ndarray:
    if part.kind == "text":
        if not isinstance(value, str):
            raise PackingError(
                f"observation part {_name(part.path)} must be a str, got {type(value).__name__}"
            )
        if len(value) > MAX_TEXT_CHARS:
            raise PackingError(
                f"observation part {_name(part.path)} is a text of {len(value)} characters, "
                f"over {MAX_TEXT_CHARS}: the environment must return its mission, not a document"
            )
        data = value.encode("utf-8", errors="replace").replace(b"\0", b"")[: part.size]
        ids = np.zeros(part.size, dtype=np.uint8)
        ids[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return ids
    array = np.asarray(value).reshape(-1)
    if array.size != part.size:
        raise PackingError(
            f"observation part {_name(part.path)} has {array.size} elements, its space says "
            f"{part.size}"
        )
    _check_values(part, array)
    if part.kind == "one-hot":
        ints = array.astype(np.int64) - part.start_array
        if _outside(ints, part):
            raise PackingError(
                f"observation part {_name(part.path)} holds a value outside its Discrete "
                f"(categories {list(part.categories)[:8]} from {list(part.starts)[:8]})"
            )
        return ints
    return array


def _outside(ints: np.ndarray, part: Part) -> bool:
    """Whether a one-hot part's values (from 0) leave their categories; one Discrete is
    compared as a Python int, a numpy reduction costing more than the whole packing."""
    if ints.size == 1:
        value = int(ints[0])
        return not 0 <= value < part.categories[0]
    return bool((ints < 0).any() or (ints >= part.category_array).any())


def _finite(array: np.ndarray) -> bool:
    """No NaN or ±inf (both survive a sum, in float64 so large finite values do not overflow);
    a short vector is summed in Python, faster than a numpy reduction's set-up."""
    total = sum(array.tolist()) if array.size <= 64 else array.sum(dtype=np.float64)
    return math.isfinite(total)


def _check_values(part: Part, array: np.ndarray) -> None:
    """Refuse values the packed array would silently change: non-numbers, NaN or infinity,
    floats for an integer part, and integers outside the range of the part's dtype. Runs for
    every observation: the common cases cost a dtype comparison or one reduction."""
    kind, leaf = array.dtype.kind, part.leaf_dtype
    if kind == "f":
        if leaf.kind != "f":
            raise PackingError(
                f"observation part {_name(part.path)} holds {array.dtype} values; its space "
                f"says {part.dtype}: return integers (e.g. np.asarray(x, dtype=np.uint8))"
            )
        if not _finite(array):
            raise PackingError(
                f"observation part {_name(part.path)} holds NaN or infinite values: fix the "
                "environment"
            )
        return
    if kind not in "biu":
        raise PackingError(
            f"observation part {_name(part.path)} holds {array.dtype} values; its space says "
            f"{part.dtype}"
        )
    if array.dtype == leaf or part.kind == "one-hot" or leaf.kind == "f" or not array.size:
        return  # its own dtype fits; one-hots are checked by category; floats hold integers
    low, high = (0, 1) if leaf.kind == "b" else (np.iinfo(leaf).min, np.iinfo(leaf).max)
    if array.min() < low or array.max() > high:
        raise PackingError(
            f"observation part {_name(part.path)} holds values outside {low}..{high}, which "
            f"its {part.dtype} space does not allow"
        )


def _decode(part: Part, values: np.ndarray) -> Any:
    if part.kind == "text":
        return values[values != 0].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    if part.kind == "one-hot":
        ints = (values.astype(np.int64) + np.array(part.starts, dtype=np.int64)).reshape(part.shape)
        return int(ints) if part.shape == () else ints
    return values.astype(np.dtype(part.dtype)).reshape(part.shape)


def _store(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _freeze(node: Any) -> Any:
    """Dicts whose keys are all ints came from Tuples: back to tuples, in index order."""
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return tuple(_freeze(node[i]) for i in range(len(node)))
    return {key: _freeze(value) for key, value in node.items()}


def _name(path: tuple[str | int, ...]) -> str:
    return "/".join(map(str, path)) or "(the whole observation)"


__all__ = [
    "KINDS",
    "Layout",
    "PackObservation",
    "PackedBox",
    "PackingError",
    "Part",
    "layout",
    "needs_packing",
    "pack",
    "unpack",
]
