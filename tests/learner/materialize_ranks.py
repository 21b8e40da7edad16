"""One rank of a real gloo group holding a deferred causal LM (spawned by
tests/learner/test_materialize.py, which also builds the lone-rank reference from here).

    python -m tests.learner.materialize_ranks SHARDING OUT [DIRECTORY]   (GroupSpec in the env)

The rank builds the policy on the meta device as a learner does (`build_policy`: from the
test's sizes, or from DIRECTORY, a save_pretrained directory), lets
`parallelize` give it storage as SHARDING says, and writes to OUT (.npz) every parameter and
buffer in full, the strategy, and how many parameter elements this rank itself holds.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from gymnasium import spaces
from torch.distributed.tensor import DTensor

from shoal.learner.group import GroupSpec, LearnerGroup, exit_after_group
from shoal.learner.materialize import build_policy, is_deferred
from shoal.learner.models import ModelConfig, PolicyModel
from shoal.learner.parallel import ShardingOptions, full_tensor, parallelize, plan_parallelism

SEED = 5
CONFIG = ModelConfig(
    family="causal-lm", arch="qwen2", vocab_size=48, hidden_size=32, num_layers=3, num_heads=4,
    num_kv_heads=2, intermediate_size=64, max_positions=32,
)  # fmt: skip


def deferred_policy(directory: str | None = None) -> PolicyModel:
    """The test's LM (3 decoder layers: 5 shard units with the embeddings and the head) on the
    meta device, from its sizes or, with `directory`, from that save_pretrained directory."""
    obs = spaces.Box(0, CONFIG.vocab_size - 1, shape=(8,), dtype=np.int64)
    cfg = CONFIG if directory is None else ModelConfig(family="causal-lm", path=directory)
    return build_policy(cfg, obs, spaces.Discrete(8), torch.device("cpu"))


def full_state(policy: PolicyModel) -> dict[str, np.ndarray]:
    tensors = [*policy.named_parameters(), *policy.named_buffers()]
    return {name: full_tensor(t).detach().numpy().copy() for name, t in tensors}


def main(sharding: str, out: str, directory: str | None) -> None:
    group = LearnerGroup(GroupSpec.from_env())
    group.join()
    policy = deferred_policy(directory)
    assert is_deferred(policy)
    plan = plan_parallelism(sharding, ["h0"] * group.world_size, 1, 1)
    parallelize(policy, plan, torch.device("cpu"), ShardingOptions(), SEED)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in policy.parameters())
    state = full_state(policy)
    group.leave()
    np.savez(out, strategy=np.array(plan.strategy), held=np.array(held), **state)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    exit_after_group(0)
