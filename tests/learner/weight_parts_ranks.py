"""One rank of a real gloo group publishing its weight-sync part of an FSDP2-sharded causal LM
(spawned by tests/learner/test_weight_parts.py).

    python -m tests.learner.weight_parts_ranks SHARDING ISLANDS OUT   (GroupSpec in the env)

The rank holds the test's LM as SHARDING says over ISLANDS (comma-separated, one island label
per rank: `fsdp` shards over the whole group, `hsdp` inside each island), cuts its part of a
version as the learner does (`owned_rows`) with every DTensor gather made to fail (a part
needs none), then the whole version the old way (every tensor gathered, for comparison), and
writes both snapshots' manifests and buckets to OUT (.npz).
"""

from __future__ import annotations

import json
import sys
from functools import partial

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from shoal.learner.group import GroupSpec, LearnerGroup, exit_after_group
from shoal.learner.parallel import (
    ShardingOptions,
    full_tensor,
    owned_rows,
    parallelize,
    plan_parallelism,
    publishing_row,
)
from shoal.learner.weight_plan import WeightSyncConfig
from shoal.learner.weight_sync import WeightSnapshot
from tests.learner.materialize_ranks import SEED, deferred_policy

CFG = WeightSyncConfig(bucket_mb=4 / 1024)


def _no_gather(tensor: DTensor) -> torch.Tensor:
    raise AssertionError("a weight-sync part gathered a sharded tensor")


def snapshot_arrays(snapshot: WeightSnapshot, prefix: str) -> dict[str, np.ndarray]:
    arrays = {f"{prefix}manifest": np.array(json.dumps(snapshot.manifest))}
    arrays[f"{prefix}checksums"] = np.array(snapshot.checksums, dtype=np.uint64)
    for index, bucket in enumerate(snapshot.buckets):
        arrays[f"{prefix}bucket{index}"] = bucket
    return arrays


def main(sharding: str, islands: str, out: str) -> None:
    group = LearnerGroup(GroupSpec.from_env())
    group.join()
    policy = deferred_policy()
    plan = plan_parallelism(sharding, islands.split(","), 1, 1)  # type: ignore[arg-type]
    assert plan.strategy == sharding
    parallelize(policy, plan, torch.device("cpu"), ShardingOptions(), SEED)
    row = publishing_row(plan, group.rank)
    part, parts = row.index(group.rank), len(row)
    params = list(policy.state_dict().items())
    gather = DTensor.full_tensor
    DTensor.full_tensor = _no_gather  # type: ignore[method-assign]
    try:
        take = partial(owned_rows, part=part, parts=parts)
        mine = WeightSnapshot.build(1, params, take, CFG, part=part, parts=parts)
    finally:
        DTensor.full_tensor = gather  # type: ignore[method-assign]
    whole = WeightSnapshot.build(1, params, full_tensor, CFG)
    group.leave()
    np.savez(out, **snapshot_arrays(mine, "part_"), **snapshot_arrays(whole, "whole_"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_after_group(0)
