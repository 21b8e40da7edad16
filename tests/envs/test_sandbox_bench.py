"""`shoal bench sandbox` runs end to end and yields rows beside their baselines (no timing asserted)."""

from __future__ import annotations

import pytest

from shoal.bench import sandbox
from shoal.bench.report import Row, render_table
from shoal.commands.bench import SUITES


@pytest.mark.timeout(120)
def test_quick_run_gives_rows_with_baselines():
    rows = sandbox.run(quick=True)
    assert len(rows) == 8
    for row in rows:
        assert isinstance(row, Row)
        assert row.shoal > 0
        assert row.baseline is not None
        assert row.baseline > 0
    assert "isolated episodes/s" in render_table("sandbox", rows)
    assert SUITES["sandbox"] == "sandbox"
