"""A small JSON-Schema subset: one schema both validates a body and documents it in OpenAPI.

Supported keywords: type (one or a list), properties, required, additionalProperties,
items, enum, minimum, maximum, exclusiveMinimum, minLength, maxLength, maxItems, maxProperties,
propertyNames, pattern, oneOf (and description, which only documents). A pattern is searched for, as in JSON Schema, so
each anchors itself with `^...$`; the check matches it against the whole string all the same. An object schema with neither properties nor
additionalProperties is free-form JSON (a job spec, task args, a health summary): it is still
checked to be plain, finite JSON of bounded depth, and so is one that declares properties but
not additionalProperties (a job spec is free-form, but the `restart` in it is read and checked).

As in JSON Schema, a number with no fractional part (`2.0`) is an integer; since the records
keep ints, `check` turns such a float into an int where the schema declares only integer: the
one change it makes to what it is given.
"""

from __future__ import annotations

import math
import re
from typing import Any

from shoal.raft.errors import ValidationError

Schema = dict[str, Any]
MAX_JSON_DEPTH = 16
_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(source: str) -> re.Pattern[str]:
    compiled = _PATTERNS.get(source)
    if compiled is None:
        compiled = _PATTERNS[source] = re.compile(source)
    return compiled


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        if type(value) is float:
            return math.isfinite(value) and value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _PY_TYPES[name])


# A field is named lazily: children get (parent, key) and the dotted path is only built when
# something is wrong, which keeps validating a 2000-command batch cheap.
Field = str | tuple[Any, str | int]


def field_name(field: Field) -> str:
    parts: list[str] = []
    while isinstance(field, tuple):
        field, key = field
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return field + "".join(reversed(parts))


def _invalid(field: Field, message: str) -> ValidationError:
    return ValidationError(field_name(field), message)


def check(schema: Schema, value: Any, field: Field = "body") -> None:
    """Raise `ValidationError` naming the first field of `value` that `schema` rejects."""
    types = schema.get("type")
    if types is not None:
        if isinstance(types, str):
            ok = _is_type(value, types)
        else:
            ok = any(_is_type(value, name) for name in types)
        if not ok:
            names = [types] if isinstance(types, str) else list(types)
            raise _invalid(field, f"must be {' or '.join(names)}, got {_kind(value)}")
    if "enum" in schema and value not in schema["enum"]:
        raise _invalid(field, f"must be one of {schema['enum']}, got {value!r}")
    kind = type(value)
    if kind is str:
        _check_string(schema, value, field)
    elif kind is dict:
        _check_object(schema, value, field)
    elif kind is list:
        _check_array(schema, value, field)
    elif kind is float or kind is int:
        if kind is float and not math.isfinite(value):
            raise _invalid(field, "must be a finite number")
        _check_number(schema, value, field)
    if "oneOf" in schema:
        _check_one_of(schema["oneOf"], value, field)


def _as_declared(schema: Schema, value: Any) -> Any:
    """An integral float where only an integer is declared, as the int the records keep."""
    if type(value) is not float:
        return value
    types = schema.get("type")
    names = [types] if isinstance(types, str) else (types or [])
    return int(value) if "integer" in names and "number" not in names else value


def _check_one_of(choices: list[Schema], value: Any, field: Field) -> None:
    """Exactly one alternative must hold; when none does, the error that got furthest into the
    value is the one to show (for a batch member, the one of its own op's arguments)."""
    candidates = [choice for choice in choices if _may_match(choice, value)]
    errors: list[ValidationError] = []
    for choice in candidates:
        try:
            check(choice, value, field)
        except ValidationError as exc:
            errors.append(exc)
    held = len(candidates) - len(errors)
    if held == 1:
        return
    if held > 1:
        raise _invalid(field, "matches more than one of its alternatives")
    if errors:
        raise max(errors, key=lambda exc: len(exc.field))
    raise _invalid(field, f"matches none of its {len(choices)} alternatives")


def _may_match(choice: Schema, value: Any) -> bool:
    """False for an alternative whose enum property the value misses, found without building
    an error: a batch of 10,000 commands then tries only each command's own op."""
    if type(value) is not dict:
        return True
    for key, sub in choice.get("properties", {}).items():
        if "enum" in sub and key in value and value[key] not in sub["enum"]:
            return False
    return True


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _check_string(schema: Schema, value: str, field: Field) -> None:
    if len(value) < schema.get("minLength", 0):
        raise _invalid(field, f"must have at least {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise _invalid(field, f"must have at most {schema['maxLength']} characters")
    if "pattern" in schema and not _pattern(schema["pattern"]).fullmatch(value):
        raise _invalid(field, f"must match {schema['pattern']}, got {value!r}")


def _check_number(schema: Schema, value: float, field: Field) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        raise _invalid(field, f"must be >= {schema['minimum']}, got {value}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise _invalid(field, f"must be > {schema['exclusiveMinimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        raise _invalid(field, f"must be <= {schema['maximum']}, got {value}")


def _check_array(schema: Schema, value: list[Any], field: Field) -> None:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise _invalid(field, f"must have at most {schema['maxItems']} items")
    items = schema.get("items")
    if items is not None:
        for i, item in enumerate(value):
            check(items, item, (field, i))
            value[i] = _as_declared(items, item)


_JSON_SCALARS = (str, int, bool, type(None))


def check_json(value: Any, field: Field, depth: int = 0) -> None:
    """Free-form values must still be plain finite JSON of bounded depth (no sets, no NaN)."""
    if depth > MAX_JSON_DEPTH:
        raise _invalid(field, f"nests deeper than {MAX_JSON_DEPTH} levels")
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise _invalid(field, f"object keys must be strings, got {key!r}")
            check_json(item, (field, key), depth + 1)
    elif kind is list:
        for i, item in enumerate(value):
            check_json(item, (field, i), depth + 1)
    elif kind is float:
        if not math.isfinite(value):
            raise _invalid(field, "must be a finite number")
    elif kind not in _JSON_SCALARS:
        raise _invalid(field, f"is not JSON (a {kind.__name__})")


def _check_object(schema: Schema, value: dict[Any, Any], field: Field) -> None:
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        raise _invalid(field, f"must have at most {schema['maxProperties']} keys, got {len(value)}")
    names = schema.get("propertyNames")
    if names is not None:
        for key in value:
            if type(key) is not str:
                raise _invalid(field, f"keys must be strings, got {key!r}")
            try:
                check(names, key, (field, key))
            except ValidationError as exc:
                raise _invalid((field, key), f"as a key, {exc.message}") from None
    if "additionalProperties" not in schema:
        check_json(value, field)
        if "properties" not in schema:
            return
    for key in schema.get("required", ()):
        if key not in value:
            raise _invalid((field, key), "is required")
    props: dict[str, Schema] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if type(key) is not str:
            raise _invalid(field, f"keys must be strings, got {key!r}")
        if key in props:
            check(props[key], item, (field, key))
            value[key] = _as_declared(props[key], item)
        elif extra is False:
            raise _invalid((field, key), f"is not a known field (known: {sorted(props)})")
        elif isinstance(extra, dict):
            check(extra, item, (field, key))
            value[key] = _as_declared(extra, item)
