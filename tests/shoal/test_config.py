"""shoal.config: the typed TOML → dataclass loader (types, unknown keys, env overrides, errors)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.config import env_var_names, load, load_toml
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
