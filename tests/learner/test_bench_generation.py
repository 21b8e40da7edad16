"""`shoal bench generation` runs end to end at its quick size and prints every row beside its
baseline; counts and finite positive figures only, no timing is asserted."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from shoal.cli import main as cli_main
from shoal.commands.bench import SUITES

METRICS = (
    "tokens/s, sampling T=1, batch 4, 8 new tokens",
    "tokens/s, greedy, batch 4, 8 new tokens",
    "tokens/s, sampling T=1, batch 1, 8 new tokens",
    "CPU per token, sampling T=1, batch 4, 8 new tokens",
    "CPU until new weights sample, mid-batch arrival, batch 4, 8 new tokens",
    "CPU per token with one mid-batch swap, batch 4, 8 new tokens",
    "swap cost in decode steps (CPU), batch 4, 8 new tokens",
)


@pytest.mark.timeout(300)
def test_quick_bench_generation_prints_every_row_beside_its_baseline(capsys):
    assert SUITES["generation"] == "generation"
    assert cli_main(["bench", "generation", "--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["metric"] for row in rows] == list(METRICS)
    for row in rows:
        assert math.isfinite(row["shoal"]), row
        assert row["shoal"] > 0, row
    compared = [row for row in rows if row["unit"] != "steps"]
    assert len(compared) == 6
    for row in compared:
        assert row["baseline"] is not None, row
        assert row["baseline"] > 0, row
    assert {row["baseline_name"] for row in rows[:3]} == {
        "HF generate(do_sample)",
        "HF generate(greedy)",
    }
