"""A generic typed loader: TOML tables (or any mapping) into frozen dataclasses.

Every section of shoal's configuration is a dataclass whose `__post_init__` checks its own
values; this module reads the files and applies `SHOAL_<SECTION>_<KEY>` environment overrides,
and shoal/config_fields.py walks the fields, converts each value to its field's type and
rejects keys that no field has. Any mistake becomes a `ConfigError` naming the source, the
dotted key, the value and what would be valid, so a user fixes a job file without reading a
traceback.

TOML files are read only through `read_toml`/`parse_toml`, which bound the size and the nesting
depth BEFORE tomllib sees the text (tomllib recurses once per `[`/`{` level and is quadratic
in the length of a dotted key), and `check_int`/`check_number` are the one range check every
section's `__post_init__` uses. Both modules import only the standard library and
shoal.errors, so any package may use them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from shoal.config_fields import FromEnv, build
from shoal.errors import ConfigError
from shoal.files import FileMissing, UnreadableFile, read_limited

T = TypeVar("T")

ENV_PREFIX = "SHOAL"


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
    return build(cls, merged, source=source, path=())


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
    """At most `limit` bytes of a regular file (`read_limited`: a FIFO or device would block
    or never end), every refusal a ConfigError naming the file."""
    try:
        return read_limited(path, limit)
    except FileMissing:
        raise ConfigError(f"{path}: no such file; pass an existing TOML file") from None
    except UnreadableFile as exc:
        raise ConfigError(f"{exc}; pass a TOML settings file") from None


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

    The string is marked (`FromEnv`) so it is parsed from text ("3" → 3, "false" → False).
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
        table[path[-1]] = FromEnv(name, environ[name])
    return merged


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}
