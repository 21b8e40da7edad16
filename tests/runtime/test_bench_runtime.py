"""Smoke test of `shoal bench runtime`: it runs end to end and its rows have the right shape.
Timings are never asserted (see COMMON rules)."""

from __future__ import annotations

import json
import math

import pytest

from shoal.bench import runtime
from shoal.bench.report import Row, render_json, render_table
from shoal.commands.bench import SUITES


@pytest.mark.timeout(120)
def test_quick_run_yields_one_row_per_figure_with_baselines() -> None:
    rows = runtime.run(quick=True)
    assert SUITES["runtime"] == "runtime"
    assert all(isinstance(row, Row) for row in rows)
    metrics = {row.metric for row in rows}
    assert {
        "local tell",
        "cross-process tell (small)",
        "cross-process pipelined ask",
        "cross-process ask p50",
        "cross-process ask p99",
        "cross-process ask p50 (TLS)",
        "stream 1 MiB float32 tensors (TLS)",
        "stream 64 KiB float32 tensors",
        "stream 1 MiB float32 tensors",
        "overrun 10x: producer RSS growth",
        "overrun 10x: consumer RSS growth",
        "CPU per small tell (both ends)",
        "CPU per pipelined ask (both ends)",
        "CPU per cross-process ask (both ends)",
        "CPU per MB streamed, 1 MiB tensors (both ends)",
    } <= metrics
    for row in rows:
        assert math.isfinite(row.shoal)
        assert row.baseline_name
        if not row.baseline_name.startswith("Ray"):
            assert row.baseline is not None
    assert "cross-process ask p50" in render_table("shoal bench runtime", rows)
    assert len(json.loads(render_json(rows))) == len(rows)
