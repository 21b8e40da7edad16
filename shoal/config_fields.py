"""Typed fields from raw values: the half of shoal.config that turns one table (TOML values, or
the text of a `SHOAL_<SECTION>_<KEY>` override) into a frozen dataclass, field by field.

`build` walks the dataclass's fields, rejects keys no field has, converts each value to its
field's type (a TOML `true` never passes for a number; an override's text is parsed by the
type: "3" → 3, "false" → False) and turns every mismatch into a ConfigError naming the source,
the dotted key, the value and what the type accepts. shoal.config reads the files and applies
the overrides; this module knows only types. Standard library and shoal.errors only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from shoal.errors import ConfigError

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class FromEnv:
    """A raw override value plus the variable it came from, so errors can name it."""

    __slots__ = ("text", "variable")

    def __init__(self, variable: str, text: str) -> None:
        self.variable = variable
        self.text = text


def build(cls: type[T], mapping: Any, *, source: str, path: tuple[str, ...], base: Any = None) -> T:
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
            section = build(
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
        raise ConfigError(prefix + str(exc) + _overrides(mapping)) from None
    except TypeError as exc:
        # Only a required field without a default can get here.
        raise ConfigError(f"{source}: {where}: {exc}") from None


def _overrides(mapping: Mapping[str, Any]) -> str:
    """Which of a section's values the environment set: a check across keys (or one in the
    class itself) fails after parsing, and the value it names may not be in the file at all."""
    names = [raw.variable for raw in mapping.values() if isinstance(raw, FromEnv)]
    return f" (set from the environment here: {', '.join(names)})" if names else ""


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _dotted(path: tuple[str, ...], key: str) -> str:
    return ".".join((*path, key))


def _convert(hint: Any, raw: Any, *, source: str, path: tuple[str, ...]) -> Any:
    if isinstance(raw, FromEnv):
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
        return build(hint, raw, source=source, path=path)
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
