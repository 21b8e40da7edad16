"""`shoal bench learning` runs a real `shoal train` and the CleanRL-style loop at its quick size;
the markdown table carries every column. Counts and finite figures only, no timing asserted."""

from __future__ import annotations

import json
import math

import pytest

from shoal.bench.learning import HEADER, TASKS, Cell, Task, markdown_row
from shoal.cli import main as cli_main


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_learning_trains_both_and_reports_returns(capsys):
    assert cli_main(["bench", "learning", "--quick", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["metric"] == "CartPole-v1 return at 4,096 steps"
    assert math.isfinite(row["shoal"])
    assert row["shoal"] > 0  # CartPole pays 1 per step: any finished episode has a return
    assert row["baseline"] > 0
    assert row["baseline_name"] == "CleanRL-style PPO"


def test_the_table_shows_mean_std_and_the_published_figure():
    task = Task("CartPole-v1", 1000, "490.04 ± 6.12 (ppo.py, 500k)", baseline=True)
    ours = Cell((100.0, 200.0, math.nan), (10.0, 20.0, 30.0))
    base = Cell((math.nan,), (5.0,))
    row = markdown_row((task, ours, base))
    assert row.startswith("| CartPole-v1  | 1,000 | 150.00 ± 70.71 | 20 | no episode ended | 5 |")
    assert row.endswith("490.04 ± 6.12 (ppo.py, 500k) |")
    assert HEADER.count("\n") == 1
    assert HEADER.splitlines()[0].count("|") == row.count("|")
    assert len({t.env_id for t in TASKS}) == len(TASKS) == 7
