"""`shoal bench chaos --quick` runs and gives one row per figure, each beside its baseline."""

from __future__ import annotations

import pytest

from shoal.bench.chaos import run
from shoal.bench.report import Row

pytestmark = pytest.mark.timeout(120)


def test_quick_rows_have_their_baselines() -> None:
    rows = run(quick=True)
    assert [(r.metric, r.unit, r.baseline_name, r.higher_is_better) for r in rows[:4]] == [
        ("proxy bulk throughput, no fault", "MB/s", "direct TCP", True),
        ("proxy 1-byte round trip p50", "µs", "direct TCP", False),
        ("relay actor ask round trip p50", "µs", "direct link", False),
        ("relay 4 MiB echo by an actor", "MB/s", "direct link", True),
    ]
    assert rows[4].metric.startswith("refute ")
    assert len(rows) == 5
    for row in rows:
        assert isinstance(row, Row)
        assert row.shoal > 0
        assert row.baseline is not None
        assert row.baseline > 0
