"""`shoal bench chaos --quick` runs and gives one row per figure, each beside its baseline."""

from __future__ import annotations

import pytest

from shoal.bench.chaos import run
from shoal.bench.report import Row

pytestmark = pytest.mark.timeout(120)


def test_quick_rows_have_their_baselines() -> None:
    rows = run(quick=True)
    assert [r.metric.split(",")[0].split(" (")[0] for r in rows][:2] == [
        "proxy bulk throughput",
        "proxy 1-byte round trip p50",
    ]
    assert len(rows) == 3
    for row in rows:
        assert isinstance(row, Row)
        assert row.shoal > 0
        assert row.baseline is not None
        assert row.baseline > 0
