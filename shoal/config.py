"""A generic typed loader: TOML tables (or any mapping) into frozen dataclasses.

Every section of shoal's configuration is a dataclass whose `__post_init__` checks its own
values; this module only knows how to walk fields, convert a value to the field's type, reject
keys that no field has, and apply `SHOAL_<SECTION>_<KEY>` environment overrides. Any mistake
becomes a `ConfigError` naming the source, the dotted key, the value and what would be valid,
so a user fixes a job file without reading a traceback.

TOML files are read only through `read_toml`/`parse_toml`, which bound the size and the nesting
depth BEFORE tomllib sees the text (tomllib recurses once per `[`/`{` level and is quadratic
in the length of a dotted key), and `check_int`/`check_number` are the one range check every
section's `__post_init__` uses. The module imports only the standard library and
shoal.errors, so any package may use it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from shoal.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "SHOAL"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def load(
    cls: type[T],
    mapping: Mapping[str, Any],
    *,
    source: str,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from `mapping`, then overlay environment overrides (os.environ by default).

    `source` names where the mapping came from (a file path, "--set", "defaults") for messages.
    Pass `environ={}` to ignore the process environment.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    merged = _apply_environment(cls, mapping, os.environ if environ is None else environ)
    return _build(cls, merged, source=source, path=())


MAX_TOML_BYTES = 256 * 1024
"""A job, scenario or coordinator file is a few KB; beyond this it is refused unread."""
MAX_TOML_DEPTH = 32
"""Deepest `[`/`{` nesting, and most dots in one key, a TOML file may have (also the deepest
nesting of the parsed tables), far below the recursion limit of the code that walks them."""


def load_toml(cls: type[T], path: Path, *, environ: Mapping[str, str] | None = None) -> T:
    """Read a TOML file into `cls`; a missing, unreadable or unparsable file is a ConfigError too."""
    return load(cls, read_toml(path), source=str(path), environ=environ)


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file at `path`, read with the size and depth bounds of
    `parse_toml`; every way the file can be wrong is a ConfigError naming it."""
    data = _read_bounded(path, MAX_TOML_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8; "
            "a TOML file is UTF-8 text (is this the right file?)"
        ) from None
    return parse_toml(text, source=str(path))


def _read_bounded(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file (a FIFO or device would block or never end)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise ConfigError(f"{path}: not a regular file; pass a TOML file")
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass an existing TOML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes; a TOML settings file is smaller")
    return data


def parse_toml(text: str, *, source: str) -> dict[str, Any]:
    """Parse TOML text from outside (a user's file): bounded in size and depth before tomllib
    runs, so no input ends in anything but a dict or a ConfigError naming `source`."""
    if len(text) > MAX_TOML_BYTES:
        raise ConfigError(f"{source}: longer than {MAX_TOML_BYTES} characters; refused unread")
    _check_toml_nesting(text, source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML ({exc}); fix the syntax") from None
    depth = _depth(data)
    if depth > MAX_TOML_DEPTH:
        raise ConfigError(
            f"{source}: tables nest deeper than {MAX_TOML_DEPTH} levels ({depth}); flatten the file"
        )
    return data


_TOML_SIGNIFICANT = re.compile(r"[\"'#\[\]{}.=,\n]")


def _check_toml_nesting(text: str, source: str) -> None:
    """One pass over `text` outside strings and comments: the `[`/`{` depth and the dots in
    each key (a segment between `=`, `,`, brackets and line ends) may not pass MAX_TOML_DEPTH."""
    depth = dots = 0
    found = _TOML_SIGNIFICANT.search(text)
    while found is not None:
        i, char = found.start(), found.group()
        if char in "\"'":
            i = _skip_string(text, i)
        elif char == "#":
            i = text.find("\n", i)
            if i < 0:
                return
        else:
            depth, dots = _count(char, depth, dots)
            if depth > MAX_TOML_DEPTH or dots > MAX_TOML_DEPTH:
                what = "brackets nest" if depth > MAX_TOML_DEPTH else "a dotted key nests"
                raise ConfigError(
                    f"{source}: {what} deeper than {MAX_TOML_DEPTH} levels "
                    f"(line {text.count(chr(10), 0, i) + 1}); flatten the file"
                )
            i += 1
        found = _TOML_SIGNIFICANT.search(text, i)


def _count(char: str, depth: int, dots: int) -> tuple[int, int]:
    """(bracket depth, dots in the current key) after `char`, one of `[]{}.=,` or a newline."""
    if char == ".":
        return depth, dots + 1
    if char in "[{":
        return depth + 1, 0
    if char in "]}":
        return max(0, depth - 1), 0
    return depth, 0


# What can end a string, or must be stepped over inside it, by kind of string.
_STRING_STOPS = {
    ('"', False): re.compile(r'["\\\n]'),
    ("'", False): re.compile(r"['\n]"),
    ('"', True): re.compile(r'["\\]'),
    ("'", True): re.compile(r"'"),
}


def _skip_string(text: str, start: int) -> int:
    """The index just past the TOML string that opens at `start` (or the end of the text).
    Basic strings honour backslash escapes; a one-line string ends at a newline too (the
    parser refuses it; the scan goes on from there); a multi-line string's closing run of
    quotes may be 3 to 5 long (up to two quotes are content), so the run ends it."""
    quote = text[start]
    multiline = text.startswith(quote * 3, start)
    stops = _STRING_STOPS[quote, multiline]
    i = start + (3 if multiline else 1)
    while (found := stops.search(text, i)) is not None:
        i = found.start()
        if text[i] == "\\":
            i += 2
        elif text[i] == "\n":
            return i
        elif not multiline:
            return i + 1
        elif text.startswith(quote * 3, i):
            while i < len(text) and text[i] == quote:
                i += 1
            return i
        else:
            i += 1
    return len(text)


def _depth(value: Any) -> int:
    """How deeply tables and arrays nest in `value`, measured without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_int(key: str, value: object, low: int, high: int | None = None) -> int:
    """`value` when it is an integer (never a bool) from `low` to `high`; else a ConfigError
    naming the key, the value and the valid range. Every section's range checks use this."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        valid = f">= {low}" if high is None else f"from {low} to {high}"
        raise ConfigError(f"{_shown(key, value)} is invalid: use an integer {valid}")
    return value


def check_number(
    key: str,
    value: object,
    *,
    above: float | None = None,
    low: float | None = None,
    high: float | None = None,
    unit: str = "",
) -> float:
    """`value` as a float when it is a finite number (never a bool) > `above`, >= `low` and
    <= `high` (each bound optional); else a ConfigError naming the key, the value and the
    range. `unit` ("seconds") is added to the message."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (
            (above is None or number > above)
            and (low is None or number >= low)
            and (high is None or number <= high)
        )
    if not ok:
        bounds = [
            f"> {above:g}" if above is not None else "",
            f">= {low:g}" if low is not None else "",
            f"<= {high:g}" if high is not None else "",
        ]
        valid = " and ".join(b for b in bounds if b)
        what = f"a number of {unit}" if unit else "a number"
        raise ConfigError(f"{_shown(key, value)} is invalid: use {what} {valid}".rstrip())
    return float(value)  # type: ignore[arg-type]


def _shown(key: str, value: object) -> str:
    """`--flag=value` for a command-line option, `key = value` for a config key."""
    return f"{key}={value!r}" if key.startswith("-") else f"{key} = {value!r}"


def env_var_names(cls: type[Any]) -> dict[str, tuple[str, ...]]:
    """Every override variable `cls` honours, mapped to the field path it sets."""
    names: dict[str, tuple[str, ...]] = {}
    for path, _ in _leaves(cls, ()):
        names["_".join((ENV_PREFIX, *path)).upper()] = path
    return names


def _leaves(cls: type[Any], prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[tuple[str, ...], Any]] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.extend(_leaves(hint, (*prefix, field.name)))
        else:
            out.append(((*prefix, field.name), hint))
    return out


def _apply_environment(
    cls: type[Any], mapping: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, Any]:
    """Copy `mapping` (deeply for sub-tables) and set each overridden leaf as a raw string.

    The string is marked so `_convert` parses it from text ("3" → 3, "false" → False).
    """
    merged = _deep_copy(mapping)
    for name, path in env_var_names(cls).items():
        if name not in environ:
            continue
        table = merged
        for part in path[:-1]:
            existing = table.get(part)
            table[part] = _deep_copy(existing) if isinstance(existing, Mapping) else {}
            table = table[part]
        table[path[-1]] = _FromEnv(name, environ[name])
    return merged


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


class _FromEnv:
    """A raw override value plus the variable it came from, so errors can name it."""

    __slots__ = ("text", "variable")

    def __init__(self, variable: str, text: str) -> None:
        self.variable = variable
        self.text = text


def _build(
    cls: type[T], mapping: Any, *, source: str, path: tuple[str, ...], base: Any = None
) -> T:
    """Build `cls` from `mapping`; keys left out keep `base`'s values (the parent's default
    for this section, which may differ from the section class's own defaults)."""
    where = ".".join(path) or "(top level)"
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"{source}: {where} must be a table of keys, got {type(mapping).__name__} {mapping!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(_dotted(path, k) for k in unknown)}; "
            f"valid keys{'' if not path else ' in [' + where + ']'}: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, raw in mapping.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(raw, Mapping):
            section = _build(
                hint, raw, source=source, path=(*path, name), base=_default(fields[name])
            )
            kwargs[name] = section
        else:
            kwargs[name] = _convert(hint, raw, source=source, path=(*path, name))
    try:
        if base is not None:
            return dataclasses.replace(base, **kwargs)
        return cls(**kwargs)
    except ConfigError as exc:
        prefix = f"{source}: " if not path else f"{source}: [{where}] "
        raise ConfigError(prefix + str(exc)) from None
    except TypeError as exc:
        # Only a required field without a default can get here.
        raise ConfigError(f"{source}: {where}: {exc}") from None


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _dotted(path: tuple[str, ...], key: str) -> str:
    return ".".join((*path, key))


def _convert(hint: Any, raw: Any, *, source: str, path: tuple[str, ...]) -> Any:
    if isinstance(raw, _FromEnv):
        try:
            return _from_text(hint, raw.text, source=source, path=path)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from environment variable {raw.variable})") from None
    return _from_value(hint, raw, source=source, path=path)


def _bad(source: str, path: tuple[str, ...], raw: Any, valid: str) -> ConfigError:
    return ConfigError(f"{source}: {'.'.join(path)} = {raw!r} is invalid; expected {valid}")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if origin is dict:
        return "a table"
    if hint is type(None):
        return "nothing (omit the key)"
    if hint is Path:
        return "a path string"
    if isinstance(hint, type):
        return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
            hint, hint.__name__
        )
    return str(hint)


def _from_value(hint: Any, raw: Any, *, source: str, path: tuple[str, ...]) -> Any:
    """Check and convert a value that already has a TOML type."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return raw
    if origin is Literal:
        if raw in typing.get_args(hint) and type(raw) in {type(a) for a in typing.get_args(hint)}:
            return raw
        raise _bad(source, path, raw, _describe(hint))
    if origin in (Union, types.UnionType):
        return _from_union(hint, raw, source=source, path=path)
    if origin in (list, tuple):
        if not isinstance(raw, list | tuple):
            raise _bad(source, path, raw, _describe(hint))
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        item = args[0] if args else Any
        items = [
            _from_value(item, v, source=source, path=(*path[:-1], f"{path[-1]}[{i}]"))
            for i, v in enumerate(raw)
        ]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
            raise _bad(source, path, raw, "a table")
        value_hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
        return {
            k: _from_value(value_hint, v, source=source, path=(*path, k)) for k, v in raw.items()
        }
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, raw, source=source, path=path)
    return _from_scalar(hint, raw, source=source, path=path)


def _from_union(hint: Any, raw: Any, *, source: str, path: tuple[str, ...]) -> Any:
    args = typing.get_args(hint)
    if raw is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _from_value(arg, raw, source=source, path=path)
        except ConfigError:
            continue
    raise _bad(source, path, raw, _describe(hint))


def _from_scalar(hint: Any, raw: Any, *, source: str, path: tuple[str, ...]) -> Any:
    # bool is an int subclass in Python; a TOML `true` must never pass for a number.
    if hint is bool:
        ok = isinstance(raw, bool)
    elif hint is int:
        ok = isinstance(raw, int) and not isinstance(raw, bool)
    elif hint is float:
        ok = isinstance(raw, int | float) and not isinstance(raw, bool)
        if ok:
            return float(raw)
    elif hint is str:
        ok = isinstance(raw, str)
    elif hint is Path:
        if isinstance(raw, str) and raw:
            return Path(raw)
        ok = isinstance(raw, Path)
    else:
        raise TypeError(f"shoal.config cannot load fields of type {hint!r} ({'.'.join(path)})")
    if not ok:
        raise _bad(source, path, raw, _describe(hint))
    return raw


def _from_text(hint: Any, text: str, *, source: str, path: tuple[str, ...]) -> Any:
    """Parse an environment override's text by the field's type, then check it as a value."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if type(None) in args and text.strip().lower() in {"", "none"}:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_text(arg, text, source=source, path=path)
            except ConfigError:
                continue
        raise _bad(source, path, text, _describe(hint))
    if origin in (list, tuple):
        item_args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        item = item_args[0] if item_args else str
        parts = [p.strip() for p in text.split(",") if p.strip()]
        items = [_from_text(item, p, source=source, path=path) for p in parts]
        return tuple(items) if origin is tuple else items
    if origin is Literal:
        for arg in typing.get_args(hint):
            if str(arg).lower() == text.strip().lower():
                return arg
        raise _bad(source, path, text, _describe(hint))
    return _from_value(
        hint, _parse_scalar(hint, text, source=source, path=path), source=source, path=path
    )


def _parse_scalar(hint: Any, text: str, *, source: str, path: tuple[str, ...]) -> Any:
    stripped = text.strip()
    try:
        if hint is bool:
            lowered = stripped.lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(text)
        if hint is int:
            return int(stripped)
        if hint is float:
            return float(stripped)
    except ValueError:
        raise _bad(source, path, text, _describe(hint)) from None
    if hint in (str, Path) or hint is Any:
        return text
    raise _bad(source, path, text, _describe(hint))
