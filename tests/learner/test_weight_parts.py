"""Weight sync in parts: each rank of a shard group publishes the rows it holds, and a rollout
actor's assembler rebuilds the version from every part in whatever order they interleave.
The split's properties (hypothesis), the assembler's handling of parts (interleaved, stale,
disagreeing, re-sent), and a real 3-rank gloo group under FSDP2 whose parts, cut with no
gather, make exactly the version that gathering every tensor makes."""

from __future__ import annotations

import itertools
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.learner.errors import WeightSyncError
from shoal.learner.parallel import ParallelPlan, owned_rows, publishing_row
from shoal.learner.rollout import StaleWatch
from shoal.learner.weight_assembler import WeightAssembler
from shoal.learner.weight_plan import WeightSyncConfig, part_range, row_span
from shoal.learner.weight_sync import WeightSnapshot
from tests.learner.materialize_ranks import deferred_policy
from tests.support.ranks import run_ranks

ODD = {
    "big": torch.randn(37, 41),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
    "count": torch.tensor([7, -3, 4, 1, 0], dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "column": torch.randn(5, 1, 2),
}
CFG = WeightSyncConfig(bucket_mb=1 / 1024)

Message = tuple[str, tuple[Any, ...]]


def part_snapshots(
    version: int,
    parts: int,
    state: dict[str, torch.Tensor] = ODD,
    cfg: WeightSyncConfig = CFG,
) -> list[WeightSnapshot]:
    params = list(state.items())
    return [
        WeightSnapshot.build(version, params, partial(owned_rows, part=p, parts=parts), cfg,
                             part=p, parts=parts)
        for p in range(parts)
    ]  # fmt: skip


def messages(snapshot: WeightSnapshot, source: str = "group-1") -> list[Message]:
    """What a rank's transfer sends for its part: begin, each bucket, commit."""
    version, part = snapshot.version, snapshot.part
    sent: list[Message] = [("begin", (version, {**snapshot.manifest, "source": source}))]
    for index, (data, crc) in enumerate(zip(snapshot.buckets, snapshot.checksums)):
        sent.append(("bucket", (version, part, index, data, crc)))
    return [*sent, ("commit", (version, part))]


def deliver(assembler: WeightAssembler, message: Message) -> Any:
    kind, args = message
    return getattr(assembler, kind)(*args)


def interleave(streams: list[list[Message]], choices: list[int]) -> list[Message]:
    """The streams merged, each kept in order, the next message taken from the stream that
    `choices` names in turn (cycling through them while any remain)."""
    pending = [list(reversed(s)) for s in streams]
    merged: list[Message] = []
    turn = 0
    while any(pending):
        live = [s for s in pending if s]
        merged.append(
            live[choices[turn % len(choices)] % len(live)].pop() if choices else live[0].pop()
        )
        turn += 1
    return merged


# -- the split -------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.integers(0, 300), st.integers(1, 40))
def test_row_span_is_torch_chunks_split(rows: int, parts: int) -> None:
    spans = [row_span(rows, p, parts) for p in range(parts)]
    chunks = [len(c) for c in torch.arange(rows).chunk(parts)] if rows else []
    assert [hi - lo for lo, hi in spans] == chunks + [0] * (parts - len(chunks))
    assert spans[0][0] == 0
    assert spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@settings(deadline=None)
@given(st.lists(st.integers(0, 7), max_size=3), st.sampled_from([1, 2, 8]), st.integers(1, 9))
def test_the_parts_tile_every_byte_of_a_tensor_once_in_order(
    shape: list[int], itemsize: int, parts: int
) -> None:
    ranges = [part_range(shape, itemsize, p, parts) for p in range(parts)]
    at = 0
    for start, length in ranges:
        assert start == at
        assert length >= 0
        at += length
    assert at == itemsize * int(np.prod(shape))


def test_a_rank_publishes_with_its_shard_group_or_alone() -> None:
    hsdp = ParallelPlan("hsdp", ((0, 1, 2), (3, 4, 5)), "two islands")
    assert publishing_row(hsdp, 4) == (3, 4, 5)
    assert publishing_row(ParallelPlan("fsdp", ((0, 1),), ""), 1) == (0, 1)
    assert publishing_row(ParallelPlan("replicate", ((0, 1),), ""), 1) == (1,)


@settings(deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["accepted", "stale", "duplicate"]), st.integers(0, 2))),
    st.integers(1, 5),
)
def test_the_stale_watch_fires_after_limit_stale_refusals_at_one_version(
    pushes: list[tuple[str, int]], limit: int
) -> None:
    watch = StaleWatch(limit)
    for n, (admission, version) in enumerate(pushes, start=1):
        fired = watch.observe(admission, version)
        tail = pushes[max(0, n - limit) : n]
        expected = len(tail) == limit and all(p == ("stale", version) for p in tail)
        assert fired is expected


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([torch.float32, torch.bool, torch.int64]), st.integers(0, 700)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["float32", "bfloat16"]),
    st.integers(1, 3),
)
def test_the_buckets_hold_each_part_cast_to_the_wire_byte_for_byte(
    tensors: list[tuple[torch.dtype, int]], wire: str, parts: int
) -> None:
    """Cast into the buckets chunk by chunk (or through a temporary where a chunk splits an
    element, as after an odd-sized bool tensor) is the parts' rows cast whole, in order."""
    generator = torch.Generator().manual_seed(len(tensors))
    state = {
        f"t{i}": (torch.randn(n, generator=generator) * 9).to(dtype)
        for i, (dtype, n) in enumerate(tensors)
    }
    cfg = WeightSyncConfig(bucket_mb=1 / 1024, wire_dtype=wire)
    for snap in part_snapshots(1, parts, state, cfg):
        take = partial(owned_rows, part=snap.part, parts=parts)
        want = b"".join(
            take(t).to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
            for t, (_, dtype, _) in zip(state.values(), snap.specs)
        )
        assert b"".join(bucket.tobytes() for bucket in snap.buckets) == want


# -- the assembler ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 4), max_size=40))
def test_parts_in_any_interleaving_rebuild_the_version_exactly(
    parts: int, choices: list[int]
) -> None:
    assembler = WeightAssembler(ODD)
    merged = interleave([messages(s) for s in part_snapshots(3, parts)], choices)
    results = [deliver(assembler, m) for m in merged]
    done = [r for r in results if isinstance(r, tuple)]
    assert len(done) == 1
    assert results[-1] is done[0]
    source, weights = done[0]
    assert source == "group-1"
    for name, tensor in ODD.items():
        assert weights[name].dtype == tensor.dtype
        assert torch.equal(weights[name], tensor), name


def test_a_newer_version_drops_a_half_one_and_older_parts_are_ignored() -> None:
    assembler = WeightAssembler(ODD)
    old, new = part_snapshots(1, 2), part_snapshots(2, 2)
    old0, old1, new0, new1 = (messages(s) for s in (*old, *new))
    for message in old0[:2]:
        deliver(assembler, message)
    deliver(assembler, new0[0])
    assert assembler.dropped == 1
    assert deliver(assembler, old1[0]) is None  # an older part: ignored, v2 kept
    assert deliver(assembler, old1[1]) is False
    for message in new0[1:] + new1[:-1]:
        deliver(assembler, message)
    assert deliver(assembler, new1[-1]) is not None
    assert assembler.dropped == 1


def test_a_part_sent_again_starts_over() -> None:
    assembler = WeightAssembler(ODD)
    first, second = (messages(s) for s in part_snapshots(4, 2))
    for message in first[:3] + first + second:  # part 0 re-sent after two of its buckets
        result = deliver(assembler, message)
    assert isinstance(result, tuple)


@pytest.mark.parametrize(
    "change",
    [{"parts": 3}, {"bucket_bytes": 2048}, {"tensors": [["big", "float32", [37, 41]]]}],
    ids=["parts", "bucket-size", "tensors"],
)
def test_a_part_that_disagrees_with_the_first_drops_the_version(change: dict[str, Any]) -> None:
    assembler = WeightAssembler(ODD)
    first, second = (messages(s) for s in part_snapshots(1, 2))
    deliver(assembler, first[0])
    version, manifest = second[0][1]
    with pytest.raises(WeightSyncError):
        assembler.begin(version, {**manifest, **change})
    assert assembler.receiving is None
    assert assembler.dropped == 1


@pytest.mark.parametrize(
    ("kind", "args"),
    [
        ("bucket", (1, 1, 0, np.zeros(4, np.uint8), 0)),  # a part that has not begun
        ("commit", (1, 1)),
        ("bucket", (1, -1, 0, np.zeros(4, np.uint8), 0)),
        ("commit", (1, "0")),
    ],
)
def test_a_bucket_or_commit_of_a_part_not_begun_is_refused(
    kind: str, args: tuple[Any, ...]
) -> None:
    assembler = WeightAssembler(ODD)
    deliver(assembler, messages(part_snapshots(1, 2)[0])[0])
    with pytest.raises(WeightSyncError, match="has not begun"):
        deliver(assembler, (kind, args))


@pytest.mark.parametrize(
    ("part", "parts"), [(2, 2), (-1, 2), (0, 0), (0, 2**20), ("0", 1), (0, None)]
)
def test_a_manifest_naming_no_real_part_is_refused(part: Any, parts: Any) -> None:
    version, manifest = messages(part_snapshots(1, 1)[0])[0][1]
    with pytest.raises(WeightSyncError, match="part"):
        WeightAssembler(ODD).begin(version, {**manifest, "part": part, "parts": parts})


def test_a_snapshot_refuses_rows_that_are_not_its_parts() -> None:
    params = list(ODD.items())
    snapshot = WeightSnapshot.plan_for(1, params, CFG, part=0, parts=2)
    with pytest.raises(WeightSyncError, match="owns"):
        snapshot.fill(params, lambda t: t)  # the whole tensors, not part 0's rows
    with pytest.raises(WeightSyncError, match="not a part"):
        WeightSnapshot.plan_for(1, params, CFG, part=2, parts=2)


# -- a real sharded group --------------------------------------------------------------------


def _snapshot(saved: dict[str, np.ndarray], prefix: str) -> list[Message]:
    manifest = json.loads(str(saved[f"{prefix}manifest"]))
    version, part = 1, manifest["part"]
    sent: list[Message] = [("begin", (version, {**manifest, "source": "g"}))]
    for index, crc in enumerate(saved[f"{prefix}checksums"].tolist()):
        sent.append(("bucket", (version, part, index, saved[f"{prefix}bucket{index}"], crc)))
    return [*sent, ("commit", (version, part))]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "islands"),
    [("fsdp", ["h0", "h0", "h0"]), ("hsdp", ["h0", "h0", "h1", "h1"])],
    ids=["fsdp-3", "hsdp-2x2"],
)
def test_a_shard_groups_parts_make_the_gathered_version_without_a_gather(
    tmp_path: Path, sharding: str, islands: list[str]
) -> None:
    outs = [tmp_path / f"rank{rank}.npz" for rank in range(len(islands))]
    module = "tests.learner.weight_parts_ranks"
    layout = ",".join(islands)
    run_ranks([[sys.executable, "-m", module, sharding, layout, str(out)] for out in outs])
    saved = [dict(np.load(out)) for out in outs]
    expected = deferred_policy().state_dict()  # names, shapes, dtypes: on the meta device
    whole = WeightAssembler(expected)
    for message in _snapshot(saved[0], "whole_"):
        gathered = deliver(whole, message)
    assert isinstance(gathered, tuple)
    total = json.loads(str(saved[0]["whole_manifest"]))["nbytes"]
    group = len(islands) // len(set(islands))  # the ranks of one shard group, in rank order
    for first in range(0, len(islands), group):
        mine = saved[first : first + group]
        parted = WeightAssembler(expected)
        for message in interleave([_snapshot(s, "part_") for s in mine], [2, 0, 1, 1]):
            result = deliver(parted, message)
        assert isinstance(result, tuple)
        assert sorted(result[1]) == sorted(gathered[1])
        for name, tensor in gathered[1].items():
            assert torch.equal(result[1][name], tensor), name
        held = [json.loads(str(s["part_manifest"]))["nbytes"] for s in mine]
        assert sum(held) == total
        assert max(held) < total / (group - 0.5)  # each rank holds about 1/group of it
