"""Smoke test of `shoal bench raft`'s building blocks: rows have the right shape (no timing asserted)."""

from __future__ import annotations

import asyncio

import pytest

from shoal.bench import raft as bench


@pytest.mark.timeout(120)
def test_raw_baseline_and_client_paths_produce_measurements() -> None:
    with bench._raw_cluster(batch=False) as raw:
        assert len(bench._raw_sequential(raw, 5)) == 5
    with bench._raw_alone() as alone:
        assert len(bench._raw_sequential(alone, 3)) == 3
    with bench._cluster(replicas=1) as one:
        assert len(asyncio.run(bench._sequential(one, 3))[0]) == 3
    with bench._cluster() as local:
        via_client, via_http = asyncio.run(bench._sequential(local, 5))
        assert len(via_client) == len(via_http) == 5
        assert asyncio.run(bench._concurrent_client(local, 200)) > 0
        assert asyncio.run(bench._failovers(local, 1))[0] > 0
