"""Smoke test of `shoal bench envs`: the rows have the right shape (timings are never asserted)."""

import json

import pytest

from shoal.cli import main


@pytest.mark.timeout(180)
def test_quick_run_rows(capsys):
    assert main(["bench", "envs", "--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [row["baseline_name"] for row in rows]
    assert "gymnasium CartPole-v1, one env" in names
    assert "gymnasium.make('CartPole-v1')" in names
    for row in rows:
        assert row["higher_is_better"] == (row["unit"] != "bytes")
        assert row["shoal"] > 0
        assert row["baseline"] > 0
