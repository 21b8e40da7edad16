"""The learner group: a real 2-rank gloo group in two processes averages gradients exactly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.learner.group import GroupError, GroupSpec, LearnerGroup, assign, resolve_backend
from shoal.local import free_port

# One learner rank: a shared init seed, rank-specific data, grad_sync, one SGD step.
_RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    from shoal.learner.group import GroupSpec, LearnerGroup

    out = sys.argv[1]
    spec = GroupSpec.from_env()
    torch.manual_seed(100 + spec.rank)  # different init per rank: broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    group = LearnerGroup(spec)
    group.join()
    group.broadcast_module(model)
    x = torch.full((5, 3), float(spec.rank + 1))
    model(x).pow(2).sum().backward()
    local = [p.grad.clone().numpy() for p in model.parameters()]
    group.grad_sync(model)
    synced = [p.grad.numpy() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    params = [p.detach().numpy() for p in model.parameters()]
    stop = group.all_agree(spec.rank == 1)
    group.leave()
    np.savez(out, *local, *synced, *params, stop=np.array(stop))
    """
)


@pytest.mark.timeout(120)
def test_two_rank_gloo_group_averages_gradients(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            spec = GroupSpec(rank=rank, world_size=2, port=port, backend="gloo", timeout_s=60)
            env = {**os.environ, **spec.to_env(), "OMP_NUM_THREADS": "1"}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(tmp_path / f"r{rank}.npz")], env=env
                )
            )
        for proc in procs:
            assert proc.wait(timeout=100) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    r0, r1 = (np.load(tmp_path / f"r{rank}.npz") for rank in range(2))
    n = 4  # parameter tensors in the model
    for i in range(n):
        local0, local1 = r0[f"arr_{i}"], r1[f"arr_{i}"]
        assert not np.allclose(local0, local1)  # the ranks really saw different data
        expected = (local0 + local1) / 2
        np.testing.assert_allclose(r0[f"arr_{n + i}"], expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(r1[f"arr_{n + i}"], expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(r0[f"arr_{2 * n + i}"], r1[f"arr_{2 * n + i}"])
    assert bool(r0["stop"])
    assert bool(r1["stop"])


def test_group_of_one_needs_no_rendezvous() -> None:
    import torch

    group = LearnerGroup(GroupSpec())
    group.join()
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    group.grad_sync(model)
    assert torch.equal(model.weight.grad, before)
    assert group.all_agree(True)
    assert not group.all_agree(False)
    assert group.is_leader


@pytest.mark.timeout(30)
def test_join_times_out_with_a_clear_error_when_peers_never_come() -> None:
    spec = GroupSpec(rank=1, world_size=2, port=free_port(), backend="gloo", timeout_s=1)
    with pytest.raises(GroupError, match="could not join"):
        LearnerGroup(spec).join()


def test_collective_before_join_is_refused() -> None:
    import torch

    group = LearnerGroup(GroupSpec(rank=0, world_size=2, port=1234, backend="gloo"))
    with pytest.raises(GroupError, match="join"):
        group.broadcast_module(torch.nn.Linear(1, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size = 0"),
        ({"rank": 2, "world_size": 2, "port": 5}, "rank = 2"),
        ({"world_size": 2, "port": 70000}, "port = 70000"),
        ({"backend": "mpi"}, "backend = 'mpi'"),
        ({"timeout_s": 0.0}, "timeout_s = 0.0"),
    ],
)
def test_bad_specs_name_the_key(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GroupSpec(**kwargs)  # type: ignore[arg-type]


def test_spec_round_trips_through_the_environment() -> None:
    spec = GroupSpec(rank=1, world_size=3, addr="127.0.0.1", port=2222, backend="gloo")
    assert GroupSpec.from_env(spec.to_env()) == spec
    with pytest.raises(ConfigError, match="SHOAL_GROUP_RANK"):
        GroupSpec.from_env({"SHOAL_GROUP_RANK": "one"})


def test_nccl_without_cuda_is_refused_and_auto_picks_gloo() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU fallback cannot be observed")
    assert resolve_backend("auto") == "gloo"
    with pytest.raises(GroupError, match="needs CUDA"):
        resolve_backend("nccl")


@given(st.lists(st.text(min_size=1, max_size=4), unique=True, max_size=20), st.integers(1, 6))
def test_assign_gives_every_actor_to_exactly_one_rank(actors: list[str], world: int) -> None:
    shares = assign(actors, world)
    assert len(shares) == world
    flat = [a for share in shares for a in share]
    assert sorted(flat) == sorted(actors)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
