"""Smoke test of `shoal bench scheduler`: the rows have the right shape (never a timing check)."""

from __future__ import annotations

import pytest

from shoal.bench import scheduler
from shoal.bench.report import Row


@pytest.mark.timeout(120)
def test_quick_run_returns_rows_with_baselines():
    rows = scheduler.run(quick=True)
    assert all(isinstance(r, Row) for r in rows)
    by_metric = {r.metric: r for r in rows}
    split = by_metric["learner groups split across NVLink islands"]
    assert split.shoal == 0.0
    assert split.baseline is not None
    assert by_metric["heartbeats from sustained overload to a migration"].shoal == 2.0
    timed = [r for r in rows if r.unit == "ms"]
    assert len(timed) == 6
    assert all(r.shoal >= 0 and r.baseline is not None and r.baseline >= 0 for r in timed)
