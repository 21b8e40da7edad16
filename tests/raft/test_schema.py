"""The JSON-Schema subset that validates request bodies and documents them: the keywords it
added for the OpenAPI document to match the server (oneOf, exclusiveMinimum, integral floats)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.raft.errors import ValidationError
from shoal.raft.route_table import BATCH_BODY
from shoal.raft.schema import check

COUNTS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "rate": {"type": "number", "exclusiveMinimum": 0},
        "counts": {"type": "array", "items": {"type": "integer"}},
    },
}


@given(st.integers(0, 2**53))
def test_an_integral_float_is_an_integer_and_is_kept_as_an_int(n: int) -> None:
    value: dict[str, Any] = {"count": float(n), "counts": [float(n), n], "rate": 2.0}
    check(COUNTS, value)
    assert type(value["count"]) is int
    assert value["count"] == n
    assert [type(c) for c in value["counts"]] == [int, int]
    assert type(value["rate"]) is float  # a number stays what it was


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ({"count": 1.5}, "body.count", "must be integer"),
        ({"count": float("inf")}, "body.count", "must be integer"),
        ({"rate": 0}, "body.rate", "must be > 0"),
        ({"counts": [1, 2.5]}, "body.counts[1]", "must be integer"),
    ],
)
def test_what_the_keywords_refuse_is_named(value: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words) as exc:
        check(COUNTS, value)
    assert exc.value.field == field


def test_one_of_names_the_field_inside_the_alternative_that_applies() -> None:
    member = {"op": "submit_job", "args": {"job_id": "-bad"}}
    with pytest.raises(ValidationError, match=r"\^\[A-Za-z0-9\]") as exc:
        check(BATCH_BODY, {"commands": [member]})
    assert exc.value.field == "body.commands[0].args.job_id"
    with pytest.raises(ValidationError) as exc:
        check(BATCH_BODY, {"commands": [{"op": "announce_leader", "args": {}}]})
    assert exc.value.field == "body.commands[0].op"
    check(BATCH_BODY, {"commands": [{"op": "stop_job", "args": {"job_id": "j1"}}]})
