"""parallelize on real gloo groups: DDP, FSDP2 and HSDP take the same PPO step.

Each rank trains on its own fragment; however the group holds the model, the gradients are
averaged over the ranks, so after one update the gathered parameters must agree across the
three strategies (to float tolerance: the reductions sum in different orders)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.support.ranks import run_ranks

_RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    from gymnasium import spaces
    from shoal.learner.fragment import Fragment
    from shoal.learner.group import GroupSpec, LearnerGroup
    from shoal.learner.models.mlp import MLPPolicy
    from shoal.learner.parallel import (
        ShardingOptions, full_tensor, parallelize, plan_parallelism,
    )
    from shoal.learner.ppo import PPOConfig, PPOLearner

    out, sharding, island = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = GroupSpec.from_env()
    group = LearnerGroup(spec)
    group.join()
    torch.manual_seed(0)
    obs_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    policy = MLPPolicy(obs_space, spaces.Discrete(2), (16, 16))
    islands = [str(i) for i in group.all_gather(island)]
    plan = plan_parallelism(sharding, islands, 1, 1)
    parallel = parallelize(policy, plan, torch.device("cpu"), ShardingOptions())
    learner = PPOLearner(parallel.module, PPOConfig(update_epochs=2, num_minibatches=2),
                         policy, parallel.forward_context)
    # Ranks 0 and 1 see different data; 2 and 3 repeat them, so a 4-rank mean is a 2-rank one.
    rng = np.random.default_rng(1 + spec.rank % 2)
    t, n = 8, 4
    obs = rng.normal(size=(t, n, 4)).astype(np.float32)
    frag = Fragment(
        actor_id=f"a{spec.rank}", seq=0, policy_version=0, env_hash="h", obs=obs,
        actions=rng.integers(0, 2, (t, n)).astype(np.int64),
        logprobs=np.full((t, n), np.log(0.5), np.float32), values=np.zeros((t, n), np.float32),
        rewards=rng.normal(size=(t, n)).astype(np.float32), dones=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool), bootstrap_value=np.zeros(n, np.float32),
        final_values=np.zeros((t, n), np.float32), episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
    )
    torch.manual_seed(7)  # the same minibatch order on every rank and in every strategy
    learner.update([frag], 0)
    params = {k: full_tensor(p).detach().numpy() for k, p in policy.named_parameters()}
    sharded = any(hasattr(p, "full_tensor") for p in policy.parameters())
    group.leave()
    np.savez(out, strategy=np.array(plan.strategy), sharded=np.array(sharded), **params)
    """
)


def run_group(tmp_path: Path, sharding: str, islands: list[str]) -> list[dict[str, np.ndarray]]:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    outs = [tmp_path / f"{sharding}-{rank}.npz" for rank in range(len(islands))]
    commands = [
        [sys.executable, str(script), str(out), sharding, island]
        for out, island in zip(outs, islands, strict=True)
    ]
    run_ranks(commands)
    return [dict(np.load(out)) for out in outs]


def assert_same_parameters(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    names = sorted(k for k in a if k not in ("strategy", "sharded"))
    assert names == sorted(k for k in b if k not in ("strategy", "sharded"))
    for name in names:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.timeout(600)
def test_ddp_fsdp_and_hsdp_take_the_same_step(tmp_path: Path) -> None:
    replicated = run_group(tmp_path, "replicate", ["h0", "h0"])
    sharded = run_group(tmp_path, "fsdp", ["h0", "h0"])
    hybrid = run_group(tmp_path, "hsdp", ["h0", "h1", "h0", "h1"])
    assert {str(r["strategy"]) for r in replicated} == {"replicate"}
    assert {str(r["strategy"]) for r in sharded} == {"fsdp"}
    assert {str(r["strategy"]) for r in hybrid} == {"hsdp"}
    assert not any(bool(r["sharded"]) for r in replicated)
    assert all(bool(r["sharded"]) for r in sharded + hybrid)
    for result in replicated[1:] + sharded + hybrid:
        assert_same_parameters(replicated[0], result)
