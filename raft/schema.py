"""A small JSON-Schema subset: one schema both validates a body and documents it in OpenAPI.

Supported keywords: type (one or a list), properties, required, additionalProperties,
items, enum, minimum, maximum, minLength, maxLength, maxItems, pattern. An object schema with
neither properties nor additionalProperties is free-form JSON (a job spec, task args, a health
summary): it is still checked to be plain, finite JSON of bounded depth. Pure functions only.
"""

from __future__ import annotations

import math
import re
from typing import Any

from shoal.raft.errors import ValidationError

Schema = dict[str, Any]
MAX_JSON_DEPTH = 16

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _PY_TYPES[name])


def check(schema: Schema, value: Any, field: str = "body") -> None:
    """Raise `ValidationError` naming the first field of `value` that `schema` rejects."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, name) for name in names):
            raise ValidationError(field, f"must be {' or '.join(names)}, got {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError(field, "must be a finite number")
    if "enum" in schema and value not in schema["enum"]:
        raise ValidationError(field, f"must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, str):
        _check_string(schema, value, field)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        _check_number(schema, value, field)
    elif isinstance(value, list):
        _check_array(schema, value, field)
    elif isinstance(value, dict):
        _check_object(schema, value, field)


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _check_string(schema: Schema, value: str, field: str) -> None:
    if len(value) < schema.get("minLength", 0):
        raise ValidationError(field, f"must have at least {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise ValidationError(field, f"must have at most {schema['maxLength']} characters")
    if "pattern" in schema and not re.fullmatch(schema["pattern"], value):
        raise ValidationError(field, f"must match {schema['pattern']}, got {value!r}")


def _check_number(schema: Schema, value: float, field: str) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        raise ValidationError(field, f"must be >= {schema['minimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        raise ValidationError(field, f"must be <= {schema['maximum']}, got {value}")


def _check_array(schema: Schema, value: list[Any], field: str) -> None:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise ValidationError(field, f"must have at most {schema['maxItems']} items")
    items = schema.get("items")
    if items is not None:
        for i, item in enumerate(value):
            check(items, item, f"{field}[{i}]")


def check_json(value: Any, field: str, depth: int = 0) -> None:
    """Free-form values must still be plain finite JSON of bounded depth (no sets, no NaN)."""
    if depth > MAX_JSON_DEPTH:
        raise ValidationError(field, f"nests deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValidationError(field, f"object keys must be strings, got {key!r}")
            check_json(item, f"{field}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{field}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(field, "must be a finite number")
    elif not isinstance(value, str | int | bool | type(None)):
        raise ValidationError(field, f"is not JSON (a {type(value).__name__})")


def _check_object(schema: Schema, value: dict[Any, Any], field: str) -> None:
    if "properties" not in schema and "additionalProperties" not in schema:
        check_json(value, field)
        return
    for key in value:
        if not isinstance(key, str):
            raise ValidationError(field, f"keys must be strings, got {key!r}")
    for key in schema.get("required", ()):
        if key not in value:
            raise ValidationError(f"{field}.{key}", "is required")
    props: dict[str, Schema] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            check(props[key], item, f"{field}.{key}")
        elif extra is False:
            raise ValidationError(
                f"{field}.{key}", f"is not a known field (known: {sorted(props)})"
            )
        elif isinstance(extra, dict):
            check(extra, item, f"{field}.{key}")
