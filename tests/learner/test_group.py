"""The learner group: a real 2-rank gloo group in two processes forms, gathers and agrees."""

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
from shoal.ports import free_port

# One learner rank: join, gather every rank's value, agree on a flag, leave, and end the process
# as a learner does (its buffered output and its log must still come out).
_RANK_SCRIPT = textwrap.dedent(
    """
    import logging
    import sys
    import numpy as np
    from shoal.learner.group import GroupSpec, LearnerGroup, exit_after_group

    out = sys.argv[1]
    spec = GroupSpec.from_env()
    group = LearnerGroup(spec)
    group.join()
    gathered = group.all_gather({"rank": spec.rank, "island": f"island-{spec.rank}"})
    stop = group.all_agree(spec.rank == 1)
    keep_going = group.all_agree(False)
    group.leave()
    np.savez(out, ranks=np.array([g["rank"] for g in gathered]), stop=np.array(stop),
             keep_going=np.array(keep_going))
    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    logging.getLogger("rank").warning("rank %d logged", spec.rank)
    sys.stdout.write(f"rank {spec.rank} done")
    exit_after_group(3 + spec.rank)
    """
)


@pytest.mark.timeout(120)
def test_two_rank_gloo_group_gathers_and_agrees(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            spec = GroupSpec(rank=rank, world_size=2, port=port, backend="gloo", timeout_s=60)
            env = {**os.environ, **spec.to_env(), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, str(script), str(tmp_path / f"r{rank}.npz")]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))  # fmt: skip
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=100)
            assert proc.returncode == 3 + rank, err.decode(errors="replace")
            assert out == f"rank {rank} done".encode()
            assert f"rank {rank} logged".encode() in err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank in range(2):
        result = np.load(tmp_path / f"r{rank}.npz")
        assert result["ranks"].tolist() == [0, 1]
        assert bool(result["stop"])
        assert not bool(result["keep_going"])


def test_group_of_one_needs_no_rendezvous() -> None:

    group = LearnerGroup(GroupSpec())
    group.join()
    assert group.all_gather("x") == ["x"]
    assert group.all_agree(True)
    assert not group.all_agree(False)
    assert group.is_leader


@pytest.mark.timeout(30)
def test_join_times_out_with_a_clear_error_when_peers_never_come() -> None:
    spec = GroupSpec(rank=1, world_size=2, port=free_port(), backend="gloo", timeout_s=1)
    with pytest.raises(GroupError, match="could not join"):
        LearnerGroup(spec).join()


def test_collective_before_join_is_refused() -> None:
    group = LearnerGroup(GroupSpec(rank=0, world_size=2, port=1234, backend="gloo"))
    with pytest.raises(GroupError, match="join"):
        group.all_gather("x")


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
