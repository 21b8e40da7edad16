"""`shoal bench train` runs end to end in quick mode and yields a well-formed table."""

from __future__ import annotations

import pytest

from shoal.bench.report import Row, render_table


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_bench_train_rows_have_the_expected_shape() -> None:
    from shoal.bench import train

    rows = train.run(quick=True)
    assert all(isinstance(row, Row) for row in rows)
    metrics = [row.metric for row in rows]
    assert metrics[:4] == [
        "CartPole-v1 time to 475",
        "CartPole-v1 time to 475 after start-up",
        "CartPole-v1 env steps to 475",
        "median policy lag while solving",
    ]
    assert "Acrobot-v1 time to -100" in metrics
    assert [m for m in metrics if "frames/s" in m] == [
        f"env frames/s trained, {n} rollout worker(s)" for n in (1, 2, 4)
    ]
    assert all(row.shoal >= 0 for row in rows if "frames/s" in row.metric)
    assert all(row.baseline_name == "CleanRL-style PPO" for row in rows if "frames/s" in row.metric)
    assert "shoal bench train" in render_table("shoal bench train", rows)
