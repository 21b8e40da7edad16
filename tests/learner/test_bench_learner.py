"""`shoal bench learner` runs end to end at tiny sizes and yields its table; its size
arguments are parsed and bounded. Counts and invariants only: no timing is asserted."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.bench.learner_child import lm_shape
from shoal.bench.report import Row, render_json, render_table
from shoal.cli import main as cli_main
from shoal.commands.bench import parameter_count


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_bench_learner_has_every_row_with_positive_finite_figures() -> None:
    from shoal.bench import learner

    rows = learner.run(quick=True)
    assert all(isinstance(row, Row) for row in rows)
    metrics = [row.metric for row in rows]
    assert sum("peak RSS per rank" in m and "2 ranks FSDP2" in m for m in metrics) == 2
    assert sum(m.startswith("peak RSS per rank, building") for m in metrics) == 2
    parts = [row for row in rows if row.metric.startswith("weight-sync snapshot")]
    assert len(parts) == 2
    assert parts[0].shoal * 4 == pytest.approx(parts[0].baseline, rel=0.01)  # a quarter each
    sync = [m for m in metrics if m.startswith("weight sync")]
    # one size in quick mode, fp32 and bf16, a time row and a throughput row each
    assert len(sync) == 4
    assert {m.split(", ")[1].split(":")[0] for m in sync} == {"fp32", "bf16"}
    assert sum(m.startswith("collective share of a step") for m in metrics) == 1
    assert sum(m.startswith("checkpoint save, blocking") for m in metrics) == 1
    assert sum(m.startswith("checkpoint save, async") for m in metrics) == 1
    assert sum(m.startswith("checkpoint load resharded 2 -> 1") for m in metrics) == 1
    for row in rows:
        assert math.isfinite(row.shoal), row
        assert row.shoal > 0, row
        assert row.baseline is not None, row
        assert math.isfinite(row.baseline), row
        assert row.baseline > 0, row
    share = next(row for row in rows if row.metric.startswith("collective share"))
    assert share.shoal <= 100.0
    assert "shoal bench learner" in render_table("shoal bench learner", rows)
    assert len(json.loads(render_json(rows))) == len(rows)


@pytest.mark.parametrize(
    ("text", "count"),
    [("1e9", 10**9), ("1B", 10**9), ("250M", 250_000_000), ("100000", 100_000), ("2.5k", None)],
)
def test_parameter_count_reads_plain_scientific_and_suffixed_numbers(
    text: str, count: int | None
) -> None:
    if count is None:
        with pytest.raises(argparse.ArgumentTypeError, match="out of range"):
            parameter_count(text)
    else:
        assert parameter_count(text) == count


@given(st.text(max_size=40))
def test_parameter_count_answers_any_text_with_a_bounded_count_or_a_usage_error(
    text: str,
) -> None:
    try:
        value = parameter_count(text)
    except argparse.ArgumentTypeError:
        return
    assert 100_000 <= value <= 10**12


@given(st.integers(min_value=100_000, max_value=10**10))
def test_lm_shape_is_a_valid_qwen2_shape(params: int) -> None:
    shape = lm_shape(params)
    assert shape["num_layers"] >= 1
    assert shape["hidden_size"] == shape["num_heads"] * 64
    assert shape["num_heads"] % shape["num_kv_heads"] == 0


def test_params_on_another_suite_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["bench", "envs", "--params", "1B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--params applies to `shoal bench learner` only" in err[0]


def test_a_malformed_params_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "learner", "--params", "lots"])
    assert exit_.value.code == 2
    assert "is not a parameter count" in capsys.readouterr().err
