"""shoal.config: the typed TOML → dataclass loader (types, unknown keys, env overrides, errors)."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.config import (
    MAX_TOML_BYTES,
    MAX_TOML_DEPTH,
    check_int,
    check_number,
    env_var_names,
    load,
    load_toml,
    parse_toml,
    read_toml,
)
from shoal.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    lr: float = 1e-3
    epochs: int = 4
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr = {self.lr!r} must be > 0")


@dataclass(frozen=True)
class Outer:
    name: str = "run"
    mode: Literal["fast", "slow"] = "fast"
    out: Path = Path("runs")
    limit: float | None = None
    tags: tuple[str, ...] = ()
    sizes: list[int] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)


def test_empty_mapping_gives_defaults() -> None:
    assert load(Outer, {}, source="t", environ={}) == Outer()


def test_all_field_kinds_convert() -> None:
    cfg = load(
        Outer,
        {
            "name": "x",
            "mode": "slow",
            "out": "/tmp/o",
            "limit": 3,
            "tags": ["a", "b"],
            "sizes": [1, 2],
            "extra": {"k": 5},
            "inner": {"lr": 0.5, "epochs": 2, "enabled": False},
        },
        source="t",
        environ={},
    )
    assert cfg == Outer(
        name="x",
        mode="slow",
        out=Path("/tmp/o"),
        limit=3.0,
        tags=("a", "b"),
        sizes=[1, 2],
        extra={"k": 5},
        inner=Inner(lr=0.5, epochs=2, enabled=False),
    )
    assert isinstance(cfg.limit, float)


@dataclass(frozen=True)
class Tuned:
    inner: Inner = field(default_factory=lambda: Inner(lr=0.5, epochs=9))


def test_a_partial_section_keeps_the_parents_default_for_it() -> None:
    cfg = load(Tuned, {"inner": {"epochs": 2}}, source="t", environ={"SHOAL_INNER_ENABLED": "0"})
    assert cfg.inner == Inner(lr=0.5, epochs=2, enabled=False)


def test_unknown_key_names_it_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        load(Outer, {"inner": {"lrr": 1.0}}, source="job.toml", environ={})
    message = str(exc.value)
    assert "job.toml" in message
    assert "inner.lrr" in message
    assert "enabled, epochs, lr" in message


def test_wrong_type_names_key_value_and_expectation() -> None:
    with pytest.raises(ConfigError) as exc:
        load(Outer, {"inner": {"epochs": "four"}}, source="job.toml", environ={})
    assert str(exc.value) == "job.toml: inner.epochs = 'four' is invalid; expected an integer"


def test_bool_is_not_an_int() -> None:
    with pytest.raises(ConfigError, match=r"inner\.epochs = True"):
        load(Outer, {"inner": {"epochs": True}}, source="t", environ={})


def test_literal_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="one of 'fast', 'slow'"):
        load(Outer, {"mode": "medium"}, source="t", environ={})


def test_post_init_error_is_prefixed_with_the_section() -> None:
    with pytest.raises(ConfigError) as exc:
        load(Outer, {"inner": {"lr": -1.0}}, source="job.toml", environ={})
    assert str(exc.value) == "job.toml: [inner] lr = -1.0 must be > 0"


def test_section_that_is_not_a_table() -> None:
    with pytest.raises(ConfigError, match="inner must be a table"):
        load(Outer, {"inner": 3}, source="t", environ={})


def test_environment_overrides_nested_and_top_level_keys() -> None:
    environ = {
        "SHOAL_INNER_LR": "0.25",
        "SHOAL_INNER_ENABLED": "no",
        "SHOAL_MODE": "SLOW",
        "SHOAL_LIMIT": "none",
        "SHOAL_SIZES": "3, 4",
    }
    cfg = load(Outer, {"inner": {"epochs": 7}, "limit": 2.0}, source="t", environ=environ)
    assert cfg.inner == Inner(lr=0.25, epochs=7, enabled=False)
    assert cfg.mode == "slow"
    assert cfg.limit is None
    assert cfg.sizes == [3, 4]


def test_bad_environment_override_names_the_variable() -> None:
    with pytest.raises(ConfigError) as exc:
        load(Outer, {}, source="t", environ={"SHOAL_INNER_EPOCHS": "many"})
    assert "inner.epochs = 'many'" in str(exc.value)
    assert "SHOAL_INNER_EPOCHS" in str(exc.value)


def test_env_var_names_cover_every_leaf() -> None:
    names = env_var_names(Outer)
    assert names["SHOAL_INNER_LR"] == ("inner", "lr")
    assert names["SHOAL_NAME"] == ("name",)
    assert len(names) == 10


def test_load_toml_reads_files_and_reports_syntax_errors(tmp_path: Path) -> None:
    good = tmp_path / "job.toml"
    good.write_text('name = "a"\n[inner]\nepochs = 9\n')
    assert load_toml(Outer, good, environ={}) == Outer(name="a", inner=Inner(epochs=9))
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(Outer, bad, environ={})
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(Outer, tmp_path / "missing.toml", environ={})


@given(st.integers(min_value=1, max_value=10**6), st.floats(min_value=1e-9, max_value=1e3))
def test_valid_values_round_trip_through_text_overrides(epochs: int, lr: float) -> None:
    environ = {"SHOAL_INNER_EPOCHS": str(epochs), "SHOAL_INNER_LR": repr(lr)}
    cfg = load(Outer, {}, source="t", environ=environ)
    assert cfg.inner.epochs == epochs
    assert math.isclose(cfg.inner.lr, lr)
    assert load(Outer, {"inner": {"epochs": epochs, "lr": lr}}, source="t", environ={}) == cfg


_junk = st.one_of(
    st.text(max_size=5), st.lists(st.integers(), max_size=2), st.none(), st.booleans()
)


@given(_junk)
def test_any_wrong_value_is_a_config_error_never_another_exception(value: object) -> None:
    for mapping in ({"inner": {"epochs": value}}, {"mode": value}, {"limit": value}):
        try:
            cfg = load(Outer, mapping, source="t", environ={})
        except ConfigError as exc:
            message = str(exc)
        else:
            message = ""
        if message:
            assert message.startswith("t: ")
            continue
        assert isinstance(cfg.inner.epochs, int)
        assert cfg.mode in ("fast", "slow")
        assert cfg.limit is None or isinstance(cfg.limit, float)


# -- the bounded TOML reader: size, encoding and nesting checked before tomllib runs ----------

# Characters that open or close something in TOML, or end a key, mixed with plain ones.
_TOML_CHARS = st.sampled_from(list("[]{}.=,#\"'\\\n\t abc1_-+:"))


def _nested(kind: str, depth: int) -> str:
    """A document nesting `depth` levels by one construct."""
    return {
        "array": "a = " + "[" * depth + "]" * depth,
        "inline": "a = " + "{b = " * depth + "1" + "}" * depth,
        "dotted": ".".join(["k"] * depth) + " = 1",
        "header": "[" + ".".join(["t"] * depth) + "]",
        "mixed": "[" + ".".join(["t"] * depth) + "]\n" + ".".join(["k"] * depth) + " = 1",
    }[kind]


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(_TOML_CHARS, max_size=400),
        st.builds(
            lambda kind, depth, pad: _nested(kind, depth) + pad,
            st.sampled_from(["array", "inline", "dotted", "header", "mixed"]),
            st.integers(min_value=0, max_value=5000),
            st.text(_TOML_CHARS, max_size=40),
        ),
    )
)
def test_any_text_is_a_dict_or_a_config_error_never_another_exception(text: str) -> None:
    try:
        data = parse_toml(text, source="job.toml")
    except ConfigError as exc:
        message = str(exc)
    else:
        assert isinstance(data, dict)
        assert data == tomllib.loads(text)
        return
    assert message.startswith("job.toml: ")


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["array", "inline", "dotted", "header"]),
    st.integers(min_value=MAX_TOML_DEPTH + 1, max_value=20_000),  # within the size bound
)
def test_nesting_past_the_bound_is_refused_before_parsing(kind: str, depth: int) -> None:
    with pytest.raises(ConfigError, match=f"nests? deeper than {MAX_TOML_DEPTH} levels"):
        parse_toml(_nested(kind, depth), source="t")


@pytest.mark.parametrize("kind", ["array", "inline", "dotted", "header"])
def test_nesting_up_to_the_bound_parses(kind: str) -> None:
    depth = MAX_TOML_DEPTH - 1  # the top-level table is one level of its own
    assert parse_toml(_nested(kind, depth), source="t")


def test_tables_nesting_past_the_bound_through_several_constructs_are_refused() -> None:
    with pytest.raises(ConfigError, match=f"tables nest deeper than {MAX_TOML_DEPTH} levels"):
        parse_toml(_nested("mixed", 20), source="t")


# Strings holding every character that means something outside a string.
_tricky_strings = st.text(st.sampled_from(list("[]{}.=,#\"'\\\n\tx\u00e9")), max_size=12)


def _toml_string(text: str, literal: bool) -> str:
    if literal and "'" not in text and "\n" not in text:
        return f"'{text}'"
    return json.dumps(text)  # a JSON string is a TOML basic string here (no DEL in the alphabet)


def _toml_value(value: object, literal: bool) -> str:
    if isinstance(value, str):
        return _toml_string(value, literal)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v, literal) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k)} = {_toml_value(v, literal)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return str(value)


_values = st.recursive(
    st.one_of(st.integers(-(2**63), 2**63 - 1), _tricky_strings),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_tricky_strings, inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_tricky_strings, _values, max_size=4), st.booleans())
def test_valid_documents_within_the_bounds_parse_exactly_as_tomllib_does(
    document: dict[str, object], literal: bool
) -> None:
    text = "\n".join(f"{json.dumps(k)} = {_toml_value(v, literal)}" for k, v in document.items())
    assert parse_toml(text, source="t") == document


def test_multi_line_strings_may_end_in_quotes_and_hide_brackets() -> None:
    text = 'a = """ [[[ "" \\""" """""\nb = [[1]]\nc = \'\'\'{{{\'\'\'\'\'\n'
    assert parse_toml(text, source="t") == {"a": ' [[[ "" """ ""', "b": [[1]], "c": "{{{''"}


def test_a_file_past_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * MAX_TOML_BYTES + "\n")
    with pytest.raises(ConfigError, match=f"larger than {MAX_TOML_BYTES:,} bytes"):
        read_toml(big)
    with pytest.raises(ConfigError, match=f"longer than {MAX_TOML_BYTES}"):
        parse_toml(big.read_text(), source="t")


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=2000))
def test_any_bytes_in_a_file_are_a_dict_or_a_config_error(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("toml") / "job.toml"
    path.write_bytes(data)
    try:
        data = read_toml(path)
    except ConfigError as exc:
        message = str(exc)
    else:
        assert isinstance(data, dict)
        return
    assert message.startswith(f"{path}: ")


def test_binary_and_special_files_name_the_file_and_the_fix(tmp_path: Path) -> None:
    binary = tmp_path / "job.toml"
    binary.write_bytes(b"\x85\x00\xff" * 10)
    with pytest.raises(ConfigError, match=r"byte 0x85 at offset 0 is not UTF-8"):
        load_toml(Outer, binary, environ={})
    with pytest.raises(ConfigError, match="not a regular file"):
        read_toml(tmp_path)


def test_check_int_and_check_number_name_the_key_the_value_and_the_range() -> None:
    assert check_int("rollout.workers", 3, 1, 8) == 3
    with pytest.raises(ConfigError) as exc:
        check_int("rollout.workers", 9, 1, 8)
    assert str(exc.value) == "rollout.workers = 9 is invalid: use an integer from 1 to 8"
    with pytest.raises(ConfigError, match=r"^--seed=-1 is invalid: use an integer >= 0$"):
        check_int("--seed", -1, 0)
    with pytest.raises(ConfigError, match="integer"):
        check_int("k", True, 0)
    assert check_number("t", 2, above=0) == 2.0
    for bad in (0, -1.0, math.inf, math.nan, True, "5"):
        with pytest.raises(ConfigError, match=r"use a number of seconds > 0$"):
            check_number("--timeout", bad, above=0, unit="seconds")
    with pytest.raises(ConfigError, match=r"use a number >= 0 and <= 1$"):
        check_number("p", 1.5, low=0, high=1)
