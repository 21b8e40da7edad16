"""Gymnasium spaces as plain JSON values, and back, for policy specs stored in checkpoints.

A spec is read back from storage, so `space_from_json` treats it as hostile: the whole value is
walked without recursion for its size and depth first, then every field is checked for type and
range (dimensions, element counts, dtypes) before numpy or gymnasium allocate anything. JSON has
no infinity, so unbounded Box limits travel as the strings "inf" and "-inf"; a Box whose limits
are one value everywhere stores that one value.

A `PackedBox` (structured observations, shoal.envs.packed_obs) is stored as its structure, a
nested JSON value of Dicts, Tuples and leaves, from which the packed Box is rebuilt; text
leaves keep only their byte length (packing stores UTF-8 byte ids, so no charset is needed).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

from shoal.envs.packed_obs import MAX_NESTING, MAX_PARTS, TEXT_BYTES, PackedBox, PackingError
from shoal.learner.errors import PolicyError

BOX_DTYPES = ("float32", "float64", "uint8", "int32", "int64")
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 26
"""Most elements in one observation (a 4096×4096×4 image); larger is refused unbuilt."""
MAX_BOUND_VALUES = 1 << 16
"""Most per-element limits a Box may list; larger Boxes must have one low and one high."""
MAX_CATEGORIES = 1 << 31
MAX_NODES = 1 << 18
"""Most values (containers and scalars) in one spec, counted before anything else is read."""
MAX_DEPTH = 16

_INF = {"inf": math.inf, "-inf": -math.inf}


def check_bounded(value: object, what: str) -> None:
    """Refuse a JSON value with more than MAX_NODES values or deeper than MAX_DEPTH (no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES or depth > MAX_DEPTH:
            raise PolicyError(
                f"{what} is larger than {MAX_NODES} values or deeper than {MAX_DEPTH} levels; "
                "it was not written by shoal: use a checkpoint of this version"
            )
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)


def space_to_json(space: spaces.Space[Any]) -> dict[str, Any]:
    """A Box, Discrete, MultiDiscrete or PackedBox as a JSON-able dict; PolicyError for any
    other space."""
    if isinstance(space, PackedBox):
        return {"type": "packed", "structure": _structure_to_json(space)}
    if isinstance(space, spaces.Box):
        if space.dtype is None or space.dtype.name not in BOX_DTYPES:
            raise PolicyError(f"Box dtype {space.dtype} is not supported; use one of {BOX_DTYPES}")
        return {
            "type": "box",
            "shape": [int(d) for d in space.shape],
            "dtype": space.dtype.name,
            "low": _bounds_to_json(space.low),
            "high": _bounds_to_json(space.high),
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiDiscrete) and space.nvec.ndim == 1:
        return {
            "type": "multi_discrete",
            "nvec": [int(v) for v in space.nvec],
            "start": [int(v) for v in space.start],
        }
    raise PolicyError(
        f"{space} cannot be described in a policy spec: use a Box, Discrete or 1-D MultiDiscrete"
    )


def space_from_json(value: object) -> spaces.Space[Any]:
    """The space `space_to_json` described; PolicyError naming the first field that is wrong."""
    check_bounded(value, "a space in the policy spec")
    if not isinstance(value, Mapping):
        raise PolicyError(f"a space in the policy spec must be an object, got {_short(value)}")
    kind = value.get("type")
    if kind == "box":
        return _box(value)
    if kind == "discrete":
        n = _integer(value, "n", 1, MAX_CATEGORIES)
        return spaces.Discrete(n, start=_integer(value, "start", -MAX_CATEGORIES, MAX_CATEGORIES))
    if kind == "multi_discrete":
        nvec = _integers(value, "nvec", 1, MAX_CATEGORIES)
        start = _integers(value, "start", -MAX_CATEGORIES, MAX_CATEGORIES)
        if len(start) != len(nvec):
            raise PolicyError("space.start must have one entry per space.nvec entry")
        return spaces.MultiDiscrete(np.array(nvec, np.int64), start=np.array(start, np.int64))
    if kind == "packed":
        try:
            return PackedBox(_structure_from_json(value.get("structure"), 0))
        except PackingError as exc:
            raise PolicyError(f"space.structure cannot be packed: {exc}") from exc
    raise PolicyError(
        f"space.type = {_short(kind)} is invalid: use 'box', 'discrete', 'multi_discrete' or "
        "'packed'"
    )


def _structure_to_json(packed: PackedBox) -> dict[str, Any]:
    """The packed space's structure, each text leaf as its byte length from the layout."""
    text_lengths = iter(p.size for p in packed.layout.parts if p.kind == "text")

    def convert(space: spaces.Space[Any]) -> dict[str, Any]:
        if isinstance(space, spaces.Dict):
            return {"type": "dict", "spaces": [[k, convert(v)] for k, v in space.spaces.items()]}
        if isinstance(space, spaces.Tuple):
            return {"type": "tuple", "spaces": [convert(v) for v in space]}
        if isinstance(space, spaces.MultiBinary):
            return {"type": "multi_binary", "shape": [int(d) for d in np.atleast_1d(space.n)]}
        if isinstance(space, spaces.Box | spaces.Discrete | spaces.MultiDiscrete):
            return space_to_json(space)
        return {"type": "text", "length": next(text_lengths)}

    return convert(packed.structure)


def _structure_from_json(value: object, depth: int) -> spaces.Space[Any]:
    """A structure `_structure_to_json` wrote; lists and nesting held to the packing limits."""
    if not isinstance(value, Mapping):
        raise PolicyError(f"space.structure holds {_short(value)}, not an object")
    kind = value.get("type")
    if kind in ("dict", "tuple"):
        items = value.get("spaces")
        if depth >= MAX_NESTING or not isinstance(items, list) or not 1 <= len(items) <= MAX_PARTS:
            raise PolicyError(
                f"space.structure: a {kind} needs a list of 1 to {MAX_PARTS} spaces, nested at "
                f"most {MAX_NESTING} deep"
            )
        if kind == "tuple":
            return spaces.Tuple([_structure_from_json(v, depth + 1) for v in items])
        # An OrderedDict keeps the stored order (a plain dict would be sorted by gymnasium).
        entries = [(_key(item), _structure_from_json(item[1], depth + 1)) for item in items]
        return spaces.Dict(OrderedDict(entries))
    if kind == "text":
        return spaces.Text(max_length=_integer(value, "length", 1, TEXT_BYTES))
    if kind == "multi_binary":
        return spaces.MultiBinary(_integers(value, "shape", 1, MAX_ELEMENTS))
    if kind not in ("box", "discrete", "multi_discrete"):
        raise PolicyError(
            f"space.structure holds a space of type {_short(kind)}: use 'dict', 'tuple', "
            "'text', 'multi_binary', 'box', 'discrete' or 'multi_discrete'"
        )
    return space_from_json(value)


def _key(item: object) -> str:
    if (
        not isinstance(item, list)
        or len(item) != 2
        or not isinstance(item[0], str)
        or not 1 <= len(item[0]) <= 200
    ):
        raise PolicyError(
            f"space.structure: a dict entry must be [key, space] with a key of 1 to 200 "
            f"characters, got {_short(item)}"
        )
    return item[0]


def _bounds_to_json(array: np.ndarray) -> Any:
    flat = array.reshape(-1)
    if flat.size and (flat == flat[0]).all():
        return _scalar_to_json(flat[0])
    if flat.size > MAX_BOUND_VALUES:
        raise PolicyError(
            f"a Box of {flat.size} elements with varying limits cannot be stored in a spec; "
            f"give it one low and one high (or at most {MAX_BOUND_VALUES} elements)"
        )
    return [_scalar_to_json(v) for v in flat]


def _scalar_to_json(value: np.generic) -> Any:
    number = value.item()
    if isinstance(number, float) and math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def _box(value: Mapping[str, Any]) -> spaces.Box:
    dtype = value.get("dtype")
    if dtype not in BOX_DTYPES:
        raise PolicyError(f"space.dtype = {_short(dtype)} is invalid: use one of {BOX_DTYPES}")
    shape = _integers(value, "shape", 1, MAX_ELEMENTS)
    if not 1 <= len(shape) <= MAX_DIMS or math.prod(shape) > MAX_ELEMENTS:
        raise PolicyError(
            f"space.shape = {shape} is invalid: use 1 to {MAX_DIMS} dimensions and at most "
            f"{MAX_ELEMENTS} elements"
        )
    low = _bound(value, "low", shape, dtype)
    high = _bound(value, "high", shape, dtype)
    if (low > high).any():
        raise PolicyError("space.low must not exceed space.high")
    return spaces.Box(low, high, shape=tuple(shape), dtype=np.dtype(dtype))


def _bound(value: Mapping[str, Any], key: str, shape: list[int], dtype: str) -> np.ndarray:
    raw = value.get(key)
    items = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and len(raw) != math.prod(shape):
        raise PolicyError(f"space.{key} lists {len(raw)} values for shape {shape}")
    kind = np.dtype(dtype)
    info = np.finfo(kind) if kind.kind == "f" else np.iinfo(kind)
    numbers = [_number(key, v, kind.kind == "f") for v in items]
    if any(math.isfinite(n) and not info.min <= n <= info.max for n in numbers):
        raise PolicyError(f"space.{key} holds a value outside the range of {dtype}")
    array = np.array(numbers, dtype=np.float64 if kind.kind == "f" else np.int64).astype(kind)
    return np.broadcast_to(array, shape).copy() if len(numbers) == 1 else array.reshape(shape)


def _number(key: str, raw: object, floating: bool) -> float | int:
    if floating and isinstance(raw, str) and raw in _INF:
        return _INF[raw]
    if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) < 1 << 63:
        return raw
    if floating and isinstance(raw, float) and math.isfinite(raw):
        return raw
    valid = "a number, 'inf' or '-inf'" if floating else "an integer within int64"
    raise PolicyError(f"space.{key} holds {_short(raw)}: each limit must be {valid}")


def _integer(value: Mapping[str, Any], key: str, low: int, high: int) -> int:
    raw = value.get(key)
    if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= high:
        raise PolicyError(f"space.{key} = {_short(raw)} is invalid: use an integer {low}..{high}")
    return raw


def _integers(value: Mapping[str, Any], key: str, low: int, high: int) -> list[int]:
    raw = value.get(key)
    if not isinstance(raw, list) or not raw or len(raw) > MAX_BOUND_VALUES:
        raise PolicyError(
            f"space.{key} = {_short(raw)} is invalid: use a list of 1 to {MAX_BOUND_VALUES} integers"
        )
    return [_integer({key: v}, key, low, high) for v in raw]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
