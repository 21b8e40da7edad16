"""Fault settings refuse bad values by name; the token bucket never exceeds its rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.chaos.errors import ProxyError
from shoal.chaos.traffic import NetFaults, TokenBucket, due_time


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"loss": 1.5}, "loss=1.5"),
        ({"delay_s": -1}, "delay_s=-1"),
        ({"delay_s": math.nan}, "delay_s=nan"),
        ({"partition": "cut"}, "partition='cut'"),
        ({"loss_mode": "eat"}, "loss_mode='eat'"),
        ({"bandwidth_bps": 0}, "bandwidth_bps=0"),
        ({"delay": 1}, "unknown fault keys"),
        ({"delay_s": "1"}, "must be a number"),
        ({"delay_s": True}, "must be a number"),
        ([1], "JSON object"),
    ],
)
def test_bad_fault_settings_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ProxyError, match=message.replace("[", r"\[")):
        NetFaults.from_dict(data)


def test_round_trip() -> None:
    faults = NetFaults(partition="blackhole", delay_s=0.1, bandwidth_bps=1000)
    assert NetFaults.from_dict(faults.to_dict()) == faults


@given(
    st.lists(st.tuples(st.integers(1, 100_000), st.floats(0, 0.5)), min_size=1, max_size=50),
    st.floats(1_000, 1e7),
    st.floats(1, 100_000),
)
def test_token_bucket_never_exceeds_its_rate(
    chunks: list[tuple[int, float]], rate: float, burst: float
) -> None:
    """Send each chunk as soon as the bucket allows: by the time the last one leaves, no more
    than burst + rate * elapsed bytes have gone."""
    bucket = TokenBucket(rate, burst, 0.0)
    now = 0.0
    sent = 0
    for size, gap in chunks:
        now += gap
        now += bucket.reserve(size, now)
        sent += size
        assert sent <= burst + rate * now + 1e-6 * sent


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(-1, 1)), max_size=50))
def test_due_times_keep_order_and_never_come_early(reads: list[tuple[float, float]]) -> None:
    now, due = 0.0, 0.0
    for gap, unit in reads:
        now += gap
        new = due_time(now, due, 0.2, 0.1, unit)
        assert new >= due
        assert new >= now + 0.1 - 1e-9
        due = new
