"""plan_parallelism: the pure choice of replicate / FSDP / HSDP from the ranks' islands."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.learner.parallel import (
    REPLICATE_SHARE,
    ParallelError,
    check_fits,
    island_rows,
    plan_parallelism,
    shard_bytes,
)

GIB = 2**30

islands_st = st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=32)
sharding_st = st.sampled_from(["auto", "replicate", "fsdp", "hsdp"])


@given(islands_st, sharding_st, st.integers(0, 64 * GIB), st.integers(1, 64 * GIB))
def test_every_rank_is_in_the_mesh_exactly_once(islands, sharding, train, memory) -> None:
    plan = plan_parallelism(sharding, islands, train, memory)
    ranks = [r for row in plan.layout for r in row]
    assert sorted(ranks) == list(range(len(islands)))
    assert len({len(row) for row in plan.layout}) == 1  # a mesh is rectangular
    assert plan.reason


@given(islands_st, sharding_st, st.integers(0, 64 * GIB), st.integers(1, 64 * GIB))
def test_a_shard_group_never_crosses_an_island_under_hsdp(islands, sharding, train, memory):
    plan = plan_parallelism(sharding, islands, train, memory)
    if plan.strategy == "hsdp":
        for row in plan.layout:
            assert len({islands[r] for r in row}) == 1
        assert len(plan.layout) > 1


@given(islands_st, st.integers(0, 64 * GIB), st.integers(1, 64 * GIB))
def test_auto_replicates_exactly_what_fits(islands, train, memory) -> None:
    plan = plan_parallelism("auto", islands, train, memory)
    if len(islands) == 1:
        assert plan.strategy == "single"
    elif train <= REPLICATE_SHARE * memory:
        assert plan.strategy == "replicate"
    else:
        assert plan.sharded


def test_the_seed_layout_is_hsdp_of_32_islands_of_16() -> None:
    islands = [f"island-{rank // 16}" for rank in range(512)]
    plan = plan_parallelism("auto", islands, 1600 * GIB, 141 * GIB)
    assert plan.strategy == "hsdp"
    assert len(plan.layout) == 32
    assert all(len(row) == 16 for row in plan.layout)


def test_interleaved_ranks_still_shard_inside_their_island() -> None:
    plan = plan_parallelism("hsdp", ["x", "y", "x", "y"], 1, 1)
    assert plan.layout == ((0, 2), (1, 3))


@pytest.mark.parametrize(
    ("islands", "why"),
    [
        (["x", "x", "y"], "different numbers"),
        (["x", "y"], "one rank per island"),
        (["x", "x"], "one island"),
    ],
)
def test_hsdp_falls_back_to_fsdp_and_says_why(islands: list[str], why: str) -> None:
    plan = plan_parallelism("hsdp", islands, 1, 1)
    assert plan.strategy == "fsdp"
    assert why in plan.reason


def test_island_rows_keep_rank_order() -> None:
    assert island_rows(["b", "a", "b", "a"]) == ((0, 2), (1, 3))


def test_an_empty_group_is_refused() -> None:
    with pytest.raises(ParallelError):
        plan_parallelism("auto", [], 0, 1)


@given(islands_st, sharding_st, st.integers(0, 64 * GIB), st.integers(1, 64 * GIB))
def test_a_plan_is_refused_exactly_when_a_ranks_share_of_the_state_outgrows_it(
    islands, sharding, train, memory
) -> None:
    plan = plan_parallelism(sharding, islands, train, memory)
    group = len(plan.layout[0]) if plan.sharded else 1
    share = shard_bytes(plan, train)
    assert share * group >= train > (share - 1) * group  # the state split evenly, rounded up
    if share <= memory:
        check_fits(plan, train, memory)
    else:
        with pytest.raises(ParallelError, match=r"per rank held as .*add ranks"):
            check_fits(plan, train, memory)


def test_the_seeds_100b_model_fits_an_h200_sharded_16_ways_and_not_replicated() -> None:
    islands = [f"island-{rank // 16}" for rank in range(512)]
    state = 16 * 100 * 10**9
    h200 = 141 * GIB
    check_fits(plan_parallelism("auto", islands, state, h200), state, h200)
    with pytest.raises(ParallelError, match="held as replicate"):
        check_fits(plan_parallelism("replicate", islands, state, h200), state, h200)
